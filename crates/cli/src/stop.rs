//! Being asked to stop: Ctrl-C (SIGINT), SIGTERM and SIGHUP all mean "stop cleanly".
//!
//! While a migration runs, a request only raises [`ferry_agent::interrupt`]'s flag: the
//! migration cancels before its commit point, the source VM keeps running, and the command ends
//! its own way (a demo or bench takes its lab down). With no migration running, the command's
//! clean-up, if it armed one, runs and the process exits: a lab the command brought up is not
//! left behind with its agents and QEMUs. Only the lab's commands arm one (feature `lab`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tokio::signal::unix::{signal, SignalKind};

type CleanUp = Box<dyn FnOnce() -> anyhow::Result<()> + Send>;

/// The armed clean-up. Whoever runs it holds the lock until it is done (a stop request: until
/// the process exits), so the command's own end and a stop request never run it twice or at once.
static CLEAN_UP: Mutex<Option<CleanUp>> = Mutex::new(None);

/// Set once a stop request will end the process.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Arms `clean_up` (taking down a lab the command brought up) for a stop request, replacing
/// any armed before; [`run_armed`] runs it at the command's own end.
#[cfg(feature = "lab")]
pub fn arm(clean_up: impl FnOnce() -> anyhow::Result<()> + Send + 'static) {
    *lock() = Some(Box::new(clean_up));
}

/// Runs the armed clean-up, if any, and disarms it (blocking). While a stop request runs it,
/// this waits, and the request ends the process.
#[cfg(feature = "lab")]
pub fn run_armed() -> anyhow::Result<()> {
    let mut armed = lock();
    armed.take().map_or(Ok(()), |clean_up| clean_up())
}

fn lock() -> std::sync::MutexGuard<'static, Option<CleanUp>> {
    CLEAN_UP
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Handles stop requests for the life of the process (spawned by `main`).
pub async fn watch() -> std::io::Result<()> {
    let mut terminate = signal(SignalKind::terminate())?;
    // Started under nohup, a hang-up is not a request to stop.
    let mut hangup = if hangup_ignored() {
        None
    } else {
        Some(signal(SignalKind::hangup())?)
    };
    loop {
        let (what, code) = tokio::select! {
            r = tokio::signal::ctrl_c() => { r?; ("interrupted", 130) }
            _ = terminate.recv() => ("terminated", 143),
            Some(()) = async { hangup.as_mut()?.recv().await } => ("hung up", 129),
        };
        if ferry_agent::interrupt::request() {
            say(&format!(
                "\nferry: {what}; cancelling the migration (the source VM keeps running)"
            ));
            continue;
        }
        STOPPING.store(true, Ordering::SeqCst);
        // Blocking: a lab comes down through processes and namespaces.
        tokio::task::spawn_blocking(move || {
            // The process ends however the clean-up goes (a panic in it included).
            struct ExitWhenDone(i32);
            impl Drop for ExitWhenDone {
                fn drop(&mut self) {
                    std::process::exit(self.0);
                }
            }
            let _exit = ExitWhenDone(code);
            let mut armed = lock();
            if let Some(clean_up) = armed.take() {
                say(&format!(
                    "\nferry: {what}; taking down what this command brought up"
                ));
                if let Err(e) = clean_up() {
                    say(&format!("ferry: {}", crate::report::error_chain(&e)));
                }
            }
        });
    }
}

/// Runs `step` (bringing a lab up, say) so that a stop request waits for it to end before it
/// takes down what the step made (blocking).
#[cfg(feature = "lab")]
pub fn guarded<T>(step: impl FnOnce() -> T) -> T {
    let _held = lock();
    step()
}

/// The command's result, unless it succeeded and its clean-up failed; the clean-up's error is
/// printed when both failed.
#[cfg(feature = "lab")]
pub fn first_error<T>(
    result: anyhow::Result<T>,
    clean_up: anyhow::Result<()>,
) -> anyhow::Result<T> {
    match (result, clean_up) {
        (Ok(v), Ok(())) => Ok(v),
        (Ok(_), Err(e)) => Err(e),
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(also)) => {
            say(&format!("ferry: {}", crate::report::error_chain(&also)));
            Err(e)
        }
    }
}

/// Writes a line to stderr, which after a hang-up may be gone: then nothing is written.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Whether SIGHUP is ignored (as `nohup` leaves it).
fn hangup_ignored() -> bool {
    // SAFETY: sigaction with a null new action only reads the current one into `current`.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGHUP, std::ptr::null(), &mut current) == 0
            && current.sa_sigaction == libc::SIG_IGN
    }
}

/// Called when the command has ended: if a stop request is ending the process, waits for it
/// (its clean-up must not be cut short, and the command's errors after the request are moot).
pub fn wait_if_stopping() {
    if STOPPING.load(Ordering::SeqCst) {
        loop {
            std::thread::park();
        }
    }
}
