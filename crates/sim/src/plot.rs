//! The simulator's pictures: line charts as SVG (plotters), one series per strategy or
//! setting, for BENCHMARKS.md.

use plotters::prelude::*;

/// One line: its name and its points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

#[derive(Debug, thiserror::Error)]
#[error("drawing {what}: {message}")]
pub struct PlotError {
    what: String,
    message: String,
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// A chart of `series` as an SVG document.
pub fn lines(
    title: &str,
    x_label: &str,
    y_label: &str,
    log_x: bool,
    series: &[Series],
) -> Result<String, PlotError> {
    let mut svg = String::new();
    draw(&mut svg, title, x_label, y_label, log_x, series).map_err(|e| PlotError {
        what: title.to_owned(),
        message: e.to_string(),
    })?;
    Ok(svg)
}

fn bounds(series: &[Series], pick: impl Fn(&(f64, f64)) -> f64) -> (f64, f64) {
    let values = series.iter().flat_map(|s| s.points.iter().map(&pick));
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (0.0, 1.0)
    }
}

fn draw(
    out: &mut String,
    title: &str,
    x_label: &str,
    y_label: &str,
    log_x: bool,
    series: &[Series],
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::with_string(out, (900, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let (x0, x1) = bounds(series, |p| p.0);
    let (_, y1) = bounds(series, |p| p.1);
    let mut chart = ChartBuilder::on(&root);
    chart
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60);
    let y_range = 0.0..y1 * 1.08;
    macro_rules! finish {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .draw()?;
            for (i, s) in series.iter().enumerate() {
                let colour = COLOURS[i % COLOURS.len()];
                chart
                    .draw_series(LineSeries::new(
                        s.points.iter().copied(),
                        colour.stroke_width(2),
                    ))?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                    });
                chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
            }
            chart
                .configure_series_labels()
                .border_style(BLACK)
                .background_style(WHITE.mix(0.85))
                .draw()?;
        }};
    }
    if log_x {
        finish!(chart.build_cartesian_2d((x0..x1).log_scale(), y_range)?);
    } else {
        finish!(chart.build_cartesian_2d(x0..x1, y_range)?);
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_is_an_svg_with_its_title_and_series() {
        let svg = lines(
            "energy against migration time",
            "seconds",
            "share",
            true,
            &[Series {
                name: "ferry".into(),
                points: vec![(1.0, 0.5), (10.0, 0.6), (100.0, 0.8)],
            }],
        )
        .unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
        assert!(svg.contains("energy against migration time") && svg.contains("ferry"));
    }
}
