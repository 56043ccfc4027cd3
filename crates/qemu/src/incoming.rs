//! A running QEMU's command line, made the destination of its own migration.
//!
//! QEMU requires both ends of a migration to have the same machine and devices, and the
//! simplest true description of them is the command line the source QEMU was started with
//! (`/proc/<pid>/cmdline`). [`incoming_argv`] keeps it, drops what belongs to the source
//! process alone (its monitors, with the chardevs they were on, `-incoming`, `-S`, a pid
//! file, daemonizing, `-loadvm`) and
//! adds what a destination needs: a QMP socket of the destination agent's own, `-S`,
//! `-incoming defer`, `-daemonize` with a pid file (the agent is not the VM's parent for long:
//! the VM outlives it).
//!
//! Paths in the command line (disk images, kernel, sockets of chardevs) are kept: on two hosts
//! they name the same things (the same image library, the same disk layout), which is what
//! QEMU's own migration assumes too.

use std::path::Path;

/// QEMU options that take no argument (qemu-options.hx, entries without HAS_ARG). Every other
/// option takes exactly one.
const NO_ARGUMENT: &[&str] = &[
    "S",
    "daemonize",
    "nographic",
    "no-reboot",
    "no-shutdown",
    "nodefaults",
    "no-user-config",
    "enable-kvm",
    "snapshot",
    "full-screen",
    "s",
    "no-hpet",
    "no-acpi",
    "no-fd-bootchk",
    "win2k-hack",
    "usb",
    "preconfig",
    "only-migratable",
    "enable-fips",
    "version",
    "help",
    "h",
    "old-param",
    "semihosting",
];

/// Options of the source process alone, dropped with their argument.
const SOURCE_ONLY: &[&str] = &[
    "qmp",
    "qmp-pretty",
    "monitor",
    "mon",
    "incoming",
    "pidfile",
    "loadvm",
    "S",
    "daemonize",
];

/// Why a command line cannot start a destination.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IncomingArgvError {
    #[error("the source QEMU's command line is empty")]
    Empty,
    #[error("option -{0} has no argument at the end of the source QEMU's command line")]
    MissingArgument(String),
    #[error("the source QEMU uses its terminal ({0}); a destination started by the agent has none (give the destination's command line instead)")]
    Terminal(String),
}

/// The destination's command line (program first) for the source's `argv` (program first):
/// its monitor on `qmp_socket`, its pid in `pidfile`.
pub fn incoming_argv(
    argv: &[String],
    qmp_socket: &Path,
    pidfile: &Path,
) -> Result<Vec<String>, IncomingArgvError> {
    let (program, args) = argv.split_first().ok_or(IncomingArgvError::Empty)?;
    let parsed = parse(args)?;
    // A monitor on a chardev (`-chardev socket,id=m,path=X -mon chardev=m`) goes with its
    // chardev: the destination would otherwise bind X, which is the source VM's monitor on
    // the same host and another VM's, or nobody's, on another.
    let monitor_chardevs: Vec<&str> = parsed
        .iter()
        .filter_map(|p| match p {
            Parsed::Option {
                name,
                value: Some(v),
                ..
            } => monitor_chardev(name, v),
            _ => None,
        })
        .collect();
    let mut out = vec![program.clone()];
    for p in parsed {
        match p {
            Parsed::Argument(token) => out.push(token.clone()),
            Parsed::Option { name, token, value } => {
                if name == "nographic" {
                    return Err(IncomingArgvError::Terminal("-nographic".into()));
                }
                if let Some(v) = value {
                    if uses_stdio(name, v) {
                        return Err(IncomingArgvError::Terminal(format!("-{name} {v}")));
                    }
                }
                let a_monitors_chardev = name == "chardev"
                    && value
                        .and_then(|v| key_value(v, "id"))
                        .is_some_and(|id| monitor_chardevs.contains(&id));
                if !SOURCE_ONLY.contains(&name) && !a_monitors_chardev {
                    out.push(token.clone());
                    out.extend(value.cloned());
                }
            }
        }
    }
    out.extend([
        "-qmp".to_owned(),
        format!("unix:{},server=on,wait=off", qmp_socket.display()),
        "-S".to_owned(),
        "-incoming".to_owned(),
        "defer".to_owned(),
        "-daemonize".to_owned(),
        "-pidfile".to_owned(),
        pidfile.display().to_string(),
    ]);
    Ok(out)
}

/// One token of a command line, or an option with its argument.
enum Parsed<'a> {
    Argument(&'a String),
    Option {
        name: &'a str,
        token: &'a String,
        value: Option<&'a String>,
    },
}

fn parse(args: &[String]) -> Result<Vec<Parsed<'_>>, IncomingArgvError> {
    let mut parsed = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let token = &args[i];
        let Some(name) = option_name(token) else {
            parsed.push(Parsed::Argument(token));
            i += 1;
            continue;
        };
        let value = if NO_ARGUMENT.contains(&name) {
            None
        } else {
            Some(
                args.get(i + 1)
                    .ok_or_else(|| IncomingArgvError::MissingArgument(name.to_owned()))?,
            )
        };
        parsed.push(Parsed::Option { name, token, value });
        i += if value.is_some() { 2 } else { 1 };
    }
    Ok(parsed)
}

/// The chardev a monitor option puts its monitor on: `-mon chardev=ID,...`, `-monitor
/// chardev:ID`, `-qmp chardev:ID`.
fn monitor_chardev<'a>(name: &str, value: &'a str) -> Option<&'a str> {
    match name {
        "mon" => key_value(value, "chardev"),
        "monitor" | "qmp" | "qmp-pretty" => value.strip_prefix("chardev:"),
        _ => None,
    }
}

/// `KEY`'s value among an option's comma-separated `key=value` parts.
fn key_value<'a>(value: &'a str, key: &str) -> Option<&'a str> {
    value
        .split(',')
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
}

/// `-name` or `--name` -> `name`; anything else is an argument.
fn option_name(token: &str) -> Option<&str> {
    let name = token
        .strip_prefix("--")
        .or_else(|| token.strip_prefix('-'))?;
    (!name.is_empty()).then_some(name)
}

/// Whether an option's argument ties the VM to its terminal.
fn uses_stdio(name: &str, value: &str) -> bool {
    match name {
        "serial" | "parallel" | "monitor" | "qmp" | "debugcon" => {
            value == "stdio" || value.starts_with("mon:stdio")
        }
        "chardev" => value == "stdio" || value.starts_with("stdio,"),
        "display" => value == "curses" || value.starts_with("curses,"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn the_source_process_parts_are_replaced_by_the_destinations() {
        let src = argv(
            "/usr/bin/qemu-system-x86_64 -name vm1 -nodefaults -machine q35 -m 256M \
             -qmp unix:/run/vm1.qmp,server=on,wait=off --monitor none -S \
             -blockdev driver=file,filename=/img/vm1.qcow2,node-name=f0 \
             -chardev socket,id=ser0,path=/run/vm1.serial,server=on,wait=off -serial chardev:ser0 \
             -incoming defer -pidfile /run/vm1.pid -daemonize",
        );
        let out = incoming_argv(&src, Path::new("/w/in.qmp"), Path::new("/w/in.pid")).unwrap();
        assert_eq!(
            out.join(" "),
            "/usr/bin/qemu-system-x86_64 -name vm1 -nodefaults -machine q35 -m 256M \
             -blockdev driver=file,filename=/img/vm1.qcow2,node-name=f0 \
             -chardev socket,id=ser0,path=/run/vm1.serial,server=on,wait=off -serial chardev:ser0 \
             -qmp unix:/w/in.qmp,server=on,wait=off -S -incoming defer -daemonize -pidfile /w/in.pid"
        );
    }

    #[test]
    fn a_monitor_goes_with_its_chardev() {
        let src = argv(
            "qemu -chardev socket,id=mon0,path=/run/vm1.qmp,server=on,wait=off \
             -mon chardev=mon0,mode=control \
             -chardev socket,id=hmp,path=/run/vm1.hmp,server=on,wait=off -monitor chardev:hmp \
             -chardev socket,id=ser0,path=/run/vm1.serial,server=on,wait=off -serial chardev:ser0",
        );
        let out = incoming_argv(&src, Path::new("/q"), Path::new("/p")).unwrap();
        assert_eq!(
            out.join(" "),
            "qemu -chardev socket,id=ser0,path=/run/vm1.serial,server=on,wait=off -serial chardev:ser0 \
             -qmp unix:/q,server=on,wait=off -S -incoming defer -daemonize -pidfile /p"
        );
    }

    #[test]
    fn an_argument_that_looks_like_an_option_stays_an_argument() {
        let src = argv("qemu -append -S -name x");
        let out = incoming_argv(&src, Path::new("/q"), Path::new("/p")).unwrap();
        assert_eq!(&out[..5], &argv("qemu -append -S -name x")[..]);
    }

    #[test]
    fn a_terminal_or_a_truncated_line_is_refused() {
        let err = |s: &str| {
            incoming_argv(&argv(s), Path::new("/q"), Path::new("/p"))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err("qemu -serial stdio"),
            "the source QEMU uses its terminal (-serial stdio); a destination started by the agent has none (give the destination's command line instead)"
        );
        assert!(err("qemu -nographic").contains("(-nographic)"));
        assert_eq!(
            err("qemu -m"),
            "option -m has no argument at the end of the source QEMU's command line"
        );
        assert_eq!(
            incoming_argv(&[], Path::new("/q"), Path::new("/p")).unwrap_err(),
            IncomingArgvError::Empty
        );
    }
}
