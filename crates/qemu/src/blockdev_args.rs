//! Which file a block node of a QEMU command line opens: the `-blockdev` options read back,
//! in either of QEMU's syntaxes (`driver=file,filename=/img/a.qcow2,node-name=f0` or JSON,
//! `{"driver":"qcow2","file":{"driver":"file","filename":"/img/a.qcow2"},...}`). A format
//! node names its file node (`file=f0`) or holds it inline (`file.filename=...`).
//! `-drive` is not read: a node it makes has no file that can be found here.

use std::collections::HashMap;
use std::path::PathBuf;

use serde_json::Value;

/// One `-blockdev`'s options, nested keys dotted (`file.filename`).
type Options = HashMap<String, String>;

/// The image file that block node `node` of `argv` opens, if `-blockdev` options say.
pub fn image_file(argv: &[String], node: &str) -> Option<PathBuf> {
    let nodes: Vec<Options> = argv
        .windows(2)
        .filter(|w| w[0] == "-blockdev" || w[0] == "--blockdev")
        .filter_map(|w| parse(&w[1]))
        .collect();
    let named = |name: &str| {
        nodes
            .iter()
            .find(|o| o.get("node-name").is_some_and(|n| n == name))
    };
    let format = named(node)?;
    if let Some(file) = format.get("filename") {
        return Some(PathBuf::from(file));
    }
    if let Some(file) = format.get("file.filename") {
        return Some(PathBuf::from(file));
    }
    named(format.get("file")?)?
        .get("filename")
        .map(PathBuf::from)
}

fn parse(arg: &str) -> Option<Options> {
    if arg.trim_start().starts_with('{') {
        let mut out = Options::new();
        flatten("", &serde_json::from_str(arg).ok()?, &mut out);
        Some(out)
    } else {
        Some(keyval(arg))
    }
}

fn flatten(prefix: &str, v: &Value, out: &mut Options) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        Value::String(s) => {
            out.insert(prefix.to_owned(), s.clone());
        }
        other => {
            out.insert(prefix.to_owned(), other.to_string());
        }
    }
}

/// QEMU's key=value list: pairs split at commas, `,,` standing for a comma in a value.
fn keyval(arg: &str) -> Options {
    let mut out = Options::new();
    let mut pair = String::new();
    let mut chars = arg.chars().peekable();
    let mut push = |pair: &mut String| {
        if let Some((k, v)) = pair.split_once('=') {
            out.insert(k.to_owned(), v.to_owned());
        }
        pair.clear();
    };
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                pair.push(',');
            } else {
                push(&mut pair);
            }
        } else {
            pair.push(c);
        }
    }
    push(&mut pair);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_format_node_on_a_named_file_node() {
        let a = argv(&[
            "qemu",
            "-blockdev",
            "driver=file,filename=/img/a,,b.qcow2,node-name=f0",
            "-blockdev",
            "driver=qcow2,file=f0,node-name=disk0",
        ]);
        assert_eq!(image_file(&a, "disk0"), Some("/img/a,b.qcow2".into()));
        assert_eq!(image_file(&a, "f0"), Some("/img/a,b.qcow2".into()));
        assert_eq!(image_file(&a, "disk1"), None);
    }

    #[test]
    fn inline_files_in_either_syntax() {
        let a = argv(&[
            "qemu",
            "-blockdev",
            "driver=qcow2,node-name=d1,file.driver=file,file.filename=/img/d1.qcow2",
            "-blockdev",
            r#"{"driver":"qcow2","node-name":"d2","file":{"driver":"file","filename":"/img/d2.qcow2"}}"#,
            "-blockdev",
            r#"{"driver":"file","node-name":"f3","filename":"/img/d3.raw"}"#,
            "-blockdev",
            r#"{"driver":"raw","node-name":"d3","file":"f3"}"#,
        ]);
        assert_eq!(image_file(&a, "d1"), Some("/img/d1.qcow2".into()));
        assert_eq!(image_file(&a, "d2"), Some("/img/d2.qcow2".into()));
        assert_eq!(image_file(&a, "d3"), Some("/img/d3.raw".into()));
    }

    #[test]
    fn drives_and_bad_json_are_not_read() {
        let a = argv(&[
            "qemu",
            "-drive",
            "file=/img/x.qcow2,node-name=x",
            "-blockdev",
            "{not json",
        ]);
        assert_eq!(image_file(&a, "x"), None);
    }
}
