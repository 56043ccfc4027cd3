//! What a name or an address in a config file or a request may be.

/// A host's name as certificates carry it: letters, digits, '-', '.', '_'.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
}

/// `host:port`, or why not.
pub fn check_address(addr: &str) -> Result<(), String> {
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(format!("{addr:?} is not host:port (e.g. 192.0.2.10:7070)")),
    }
}
