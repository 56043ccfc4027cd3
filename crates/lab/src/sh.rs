//! Running host commands with errors that say which command failed and what it printed.

use std::process::{Command, Output, Stdio};

use anyhow::{bail, Context, Result};

/// Runs `program args...`, fails with its stderr when it exits non-zero; returns its stdout.
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = output(program, args)?;
    if !out.status.success() {
        bail!(
            "`{} {}` failed ({}): {}",
            program,
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs a command and returns its output whatever its exit status.
pub fn output(program: &str, args: &[&str]) -> Result<Output> {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!("cannot run `{program}` (is it installed? scripts/setup.sh installs it)")
        })
}

/// Runs a command inside network namespace `ns`.
pub fn run_in(ns: &str, program: &str, args: &[&str]) -> Result<String> {
    let mut full = vec!["netns", "exec", ns, program];
    full.extend_from_slice(args);
    run("ip", &full)
}

/// Runs `sh -c script`; for pipelines.
pub fn shell(script: &str) -> Result<String> {
    run("sh", &["-c", script])
}

/// Runs `ip ARGS` (split on whitespace) inside namespace `ns`, or in this one when `ns` is empty.
pub fn ip_in(ns: &str, args: &str) -> Result<String> {
    let args: Vec<&str> = args.split_whitespace().collect();
    if ns.is_empty() {
        run("ip", &args)
    } else {
        run_in(ns, "ip", &args)
    }
}
