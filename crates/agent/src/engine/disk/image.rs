//! The disk images a destination lacks, made before the agent starts its QEMU (which would
//! otherwise refuse to open them). Where the source's image is an overlay and the same
//! backing chain is here, byte for byte (the digest SnapMig compares), the new image is an
//! overlay naming the same backing file the same way, and only the source's overlay crosses;
//! otherwise it is a whole image of the disk's size and format, and the whole disk crosses.
//! Only where the image's directory exists: a missing directory (an unmounted volume) is the
//! host's to fix. What was made goes again if the migration fails.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ferry_qemu::blockdev_args::image_file;

use super::backing::{chain_digest, content_sha256};
use crate::engine::control::DiskPlan;

/// Makes each image of `disks` that `argv` opens and this host lacks. Returns what it made.
pub async fn make_missing(argv: &[String], disks: &[DiskPlan]) -> Result<Vec<PathBuf>> {
    let mut made = Vec::new();
    for plan in disks {
        match make_one(argv, plan).await {
            Ok(Some(path)) => made.push(path),
            Ok(None) => {}
            Err(e) => {
                remove(&made);
                return Err(e.context(format!("making disk {:?}'s image", plan.node)));
            }
        }
    }
    Ok(made)
}

/// Removes images [`make_missing`] made (the migration failed).
pub fn remove(made: &[PathBuf]) {
    for path in made {
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!(
                "removing {} made for a failed migration: {e}",
                path.display()
            );
        }
    }
}

async fn make_one(argv: &[String], plan: &DiskPlan) -> Result<Option<PathBuf>> {
    let (Some(shape), Some(path)) = (&plan.image, image_file(argv, &plan.node)) else {
        return Ok(None);
    };
    if path.try_exists().unwrap_or(true) {
        return Ok(None);
    }
    let dir = path.parent().unwrap_or(Path::new("/"));
    if !dir.is_dir() {
        bail!(
            "{}: its directory {} is not on this host",
            path.display(),
            dir.display()
        );
    }
    let size = plan.size.to_string();
    let path_s = path.to_string_lossy().into_owned();
    let mut args = vec!["create", "-q", "-f", &shape.format];
    // The chain here, when it is the source's: the backing file's format as found here.
    let same_chain = match (&shape.backing, &plan.backing_sha256) {
        (Some(backing), Some(theirs)) => {
            let here = dir.join(backing);
            match chain_of(&here).await {
                Ok(ours) if &ours.digest == theirs => Some(ours.format),
                Ok(_) => {
                    tracing::info!(
                        "{}: the backing chain here differs from the source's: a whole image",
                        here.display()
                    );
                    None
                }
                Err(e) => {
                    tracing::info!("{}: {e:#}: a whole image", here.display());
                    None
                }
            }
        }
        _ => None,
    };
    if let Some(found_format) = &same_chain {
        let backing = shape.backing.as_deref().expect("matched above");
        args.extend(["-b", backing]);
        // qemu-img refuses an overlay without its backing file's format; an older source
        // image may not record it, so the format found here stands in.
        args.extend([
            "-F",
            shape.backing_format.as_deref().unwrap_or(found_format),
        ]);
    }
    args.extend([path_s.as_str(), size.as_str()]);
    qemu_img(&args).await?;
    tracing::info!(
        "made {} ({}{})",
        path.display(),
        shape.format,
        if same_chain.is_some() {
            format!(" on {}", shape.backing.as_deref().unwrap_or_default())
        } else {
            String::new()
        }
    );
    Ok(Some(path))
}

/// A backing chain on this host, from its top image down.
struct Chain {
    /// The digest of the chain (the image itself and every backing file below it), as the
    /// source computes it for the files below its overlay.
    digest: String,
    /// The top image's format, as `qemu-img` finds it.
    format: String,
}

async fn chain_of(image: &Path) -> Result<Chain> {
    let info = qemu_img(&[
        "info",
        "-U",
        "--backing-chain",
        "--output=json",
        &image.to_string_lossy(),
    ])
    .await?;
    let chain: Vec<serde_json::Value> =
        serde_json::from_str(&info).context("qemu-img info's output")?;
    let mut hashes = Vec::with_capacity(chain.len());
    for layer in &chain {
        let file = layer["filename"]
            .as_str()
            .context("qemu-img info: a layer without its filename")?;
        hashes.push(content_sha256(Path::new(file)).await?);
    }
    let format = chain
        .first()
        .and_then(|top| top["format"].as_str())
        .context("qemu-img info: no format for the image")?;
    Ok(Chain {
        digest: chain_digest(&hashes),
        format: format.to_owned(),
    })
}

async fn qemu_img(args: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new("qemu-img")
        .args(args)
        .output()
        .await
        .context("running qemu-img (install qemu-utils)")?;
    if !out.status.success() {
        bail!(
            "qemu-img {}: {}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::control::ImageShape;

    const SIZE: u64 = 4 << 20;

    fn qemu_img_ok(args: &[&str]) -> String {
        let out = std::process::Command::new("qemu-img")
            .args(args)
            .output()
            .expect("qemu-img (scripts/setup.sh installs it)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn argv(top: &Path) -> Vec<String> {
        [
            "qemu".to_owned(),
            "-blockdev".to_owned(),
            format!("driver=file,filename={},node-name=d-file", top.display()),
            "-blockdev".to_owned(),
            "driver=qcow2,file=d-file,node-name=d".to_owned(),
        ]
        .into()
    }

    fn plan(backing_sha256: Option<String>) -> DiskPlan {
        DiskPlan {
            node: "d".into(),
            size: SIZE,
            backing_sha256,
            tracked_since: Vec::new(),
            layers: Vec::new(),
            image: Some(ImageShape {
                format: "qcow2".into(),
                backing: Some("base.qcow2".into()),
                backing_format: Some("qcow2".into()),
            }),
        }
    }

    fn backing_of_image(image: &Path) -> Option<String> {
        let info: serde_json::Value = serde_json::from_str(&qemu_img_ok(&[
            "info",
            "-U",
            "--output=json",
            &image.to_string_lossy(),
        ]))
        .unwrap();
        info["backing-filename"].as_str().map(str::to_owned)
    }

    /// A source image that does not record its backing file's format: the overlay made here
    /// names the format this host finds (qemu-img refuses one without).
    #[tokio::test]
    async fn an_overlay_whose_source_names_no_backing_format_gets_the_one_found_here() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        let size = SIZE.to_string();
        qemu_img_ok(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            &base.to_string_lossy(),
            &size,
        ]);
        let ours = chain_of(&base).await.unwrap();
        assert_eq!(ours.format, "qcow2");
        let top = dir.path().join("top.qcow2");
        let mut plan = plan(Some(ours.digest));
        plan.image.as_mut().unwrap().backing_format = None;
        let made = make_missing(&argv(&top), &[plan]).await.unwrap();
        assert_eq!(made, vec![top.clone()]);
        let info: serde_json::Value = serde_json::from_str(&qemu_img_ok(&[
            "info",
            "-U",
            "--output=json",
            &top.to_string_lossy(),
        ]))
        .unwrap();
        assert_eq!(info["backing-filename"], "base.qcow2", "{info}");
        assert_eq!(info["backing-filename-format"], "qcow2", "{info}");
    }

    #[tokio::test]
    async fn a_missing_overlay_is_made_on_the_same_chain_by_the_same_name_and_else_whole() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        qemu_img_ok(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            &base.to_string_lossy(),
            &SIZE.to_string(),
        ]);
        let ours = chain_of(&base).await.unwrap().digest;
        let top = dir.path().join("top.qcow2");

        let made = make_missing(&argv(&top), &[plan(Some(ours.clone()))])
            .await
            .unwrap();
        assert_eq!(made, vec![top.clone()]);
        assert_eq!(backing_of_image(&top).as_deref(), Some("base.qcow2"));
        // An image that exists is never touched.
        assert!(make_missing(&argv(&top), &[plan(Some(ours))])
            .await
            .unwrap()
            .is_empty());
        remove(&made);
        assert!(!top.exists());

        // Another chain at the source: a whole image, on nothing.
        let made = make_missing(&argv(&top), &[plan(Some("other".into()))])
            .await
            .unwrap();
        assert_eq!(made, vec![top.clone()]);
        assert_eq!(backing_of_image(&top), None);
    }

    #[tokio::test]
    async fn a_missing_directory_is_named_and_nothing_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join("gone").join("top.qcow2");
        let err = make_missing(&argv(&top), &[plan(None)]).await.unwrap_err();
        assert_eq!(
            format!("{err:#}"),
            format!(
                "making disk \"d\"'s image: {}: its directory {} is not on this host",
                top.display(),
                top.parent().unwrap().display()
            )
        );
    }
}
