//! Memory lent to peers' VMs as swap: Overdriver's cooperative swap (Williams et al.), where a
//! host in a transient overload pages its VMs out to peers' spare memory instead of migrating
//! them. This is the lending side: a peer's swap tunnel ([`TunnelKind::Swap`]) reaches an NBD
//! server here whose export lives in this agent's RAM, within `[host] lend_mib` for all loans
//! together. The borrowing side is [`crate::borrow`].
//!
//! The export QEMU asks for is named `<domain>:<MiB>`: the borrower's domain and the swap's
//! size. The whole size is reserved when the export is first opened (the spare memory a
//! capacity planner sized, not what happens to be free at a burst's peak); pages are allocated
//! only when written, and a trimmed or zeroed range gives its pages back. A loan ends when its
//! client disconnects cleanly (NBD_CMD_DISC: the borrower unplugged the disk after the guest
//! swapped off). A connection that breaks instead (the borrowing agent restarted, the session
//! gave up on the WAN) keeps the loan and its pages for [`KEEP_DETACHED`]: the borrower's QEMU
//! reconnects (`reconnect-delay`, [`crate::borrow`]) and finds the guest's pages where they were.
//!
//! [`TunnelKind::Swap`]: crate::engine::control::TunnelKind::Swap

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use ferry_qemu::nbd::proto::{EINVAL, EIO};
use ferry_qemu::nbd::{Blocks, Export, Exports};

/// The unit pages are kept in: the guest's page, what its swap writes.
const PAGE_BYTES: usize = 4096;
const PAGE: u64 = PAGE_BYTES as u64;
/// The largest swap one loan may be (a bound on a peer's request before anything else).
pub const MAX_LOAN_BYTES: u64 = 1 << 40;
/// How long a loan whose connection broke waits for its borrower to reconnect.
pub const KEEP_DETACHED: Duration = Duration::from_secs(300);

/// A loan's pages by index.
type Pages = Arc<Mutex<HashMap<u64, Box<[u8]>>>>;
/// A loan's borrower: its agent and domain.
type Key = (String, String);

/// This host's memory for loans, and the loans.
#[derive(Debug)]
pub struct Lender {
    limit: u64,
    loans: Mutex<HashMap<Key, Kept>>,
}

/// One loan as the lender keeps it, across its connections.
#[derive(Debug)]
struct Kept {
    size: u64,
    pages: Pages,
    /// A connection serves it now.
    attached: bool,
    /// Counts attachments: a detached loan's expiry is for the detachment that set it.
    attachments: u64,
}

impl Lender {
    pub fn new(limit_bytes: u64) -> Arc<Lender> {
        Arc::new(Lender {
            limit: limit_bytes,
            loans: Mutex::default(),
        })
    }

    /// The bytes lent now (reserved, attached or waiting for their borrower).
    pub fn lent(&self) -> u64 {
        self.loans
            .lock()
            .expect("loans lock")
            .values()
            .map(|k| k.size)
            .sum()
    }

    /// Opens `domain`'s loan of `size` for agent `from`: the one it had, if its connection
    /// broke, else a new one within the limit; or says why not (the borrower's agent is told).
    fn open(&self, key: &Key, size: u64) -> Result<(Pages, u64), String> {
        let (from, domain) = key;
        let mut loans = self.loans.lock().expect("loans lock");
        if let Some(kept) = loans.get_mut(key) {
            if kept.attached {
                return Err(format!("{from}'s domain {domain:?} already has swap here"));
            }
            if kept.size != size {
                return Err(format!(
                    "{from}'s domain {domain:?} has {} MiB of swap here, not {} MiB",
                    kept.size >> 20,
                    size >> 20
                ));
            }
            kept.attached = true;
            kept.attachments += 1;
            tracing::info!("{from}'s domain {domain:?} is back for its swap");
            return Ok((kept.pages.clone(), kept.attachments));
        }
        let used: u64 = loans.values().map(|k| k.size).sum();
        let free = self.limit.saturating_sub(used);
        if size > free {
            return Err(if self.limit == 0 {
                "this agent lends no memory ([host] lend_mib in its config)".to_owned()
            } else {
                format!(
                    "this agent has {} MiB left to lend of its {} MiB, not {} MiB",
                    free >> 20,
                    self.limit >> 20,
                    size >> 20
                )
            });
        }
        let pages = Pages::default();
        loans.insert(
            key.clone(),
            Kept {
                size,
                pages: pages.clone(),
                attached: true,
                attachments: 1,
            },
        );
        tracing::info!("lending {} MiB to {from}'s domain {domain:?}", size >> 20);
        Ok((pages, 1))
    }

    /// A connection to a loan ended: cleanly, the loan ends; otherwise it waits for its
    /// borrower for [`KEEP_DETACHED`].
    fn close(self: &Arc<Self>, key: &Key, attachment: u64, clean: bool) {
        let mut loans = self.loans.lock().expect("loans lock");
        let Some(kept) = loans.get_mut(key) else {
            return;
        };
        if kept.attachments != attachment {
            return;
        }
        if clean {
            loans.remove(key);
            return;
        }
        kept.attached = false;
        let resident = kept.pages.lock().expect("pages lock").len();
        tracing::warn!(
            "{}'s domain {:?} lost its swap connection; its {} MiB wait {}s for it",
            key.0,
            key.1,
            (resident * PAGE_BYTES) >> 20,
            KEEP_DETACHED.as_secs()
        );
        let (lender, expiring) = (self.clone(), key.clone());
        let expire = async move {
            let key = expiring;
            tokio::time::sleep(KEEP_DETACHED).await;
            let mut loans = lender.loans.lock().expect("loans lock");
            if loans
                .get(&key)
                .is_some_and(|k| !k.attached && k.attachments == attachment)
            {
                loans.remove(&key);
                tracing::warn!(
                    "{}'s domain {:?} did not come back: its swap is gone",
                    key.0,
                    key.1
                );
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(expire)),
            Err(_) => drop(loans.remove(key)),
        }
    }
}

/// Parses an export name `<domain>:<MiB>`.
fn parse_export_name(name: &str) -> Result<(&str, u64), String> {
    let bad = || format!("swap export {name:?}: expected <domain>:<MiB>");
    let (domain, mib) = name.rsplit_once(':').ok_or_else(bad)?;
    let mib: u64 = mib.parse().map_err(|_| bad())?;
    if domain.is_empty() || mib == 0 || mib.saturating_mul(1 << 20) > MAX_LOAN_BYTES {
        return Err(bad());
    }
    Ok((domain, mib << 20))
}

/// One swap connection's export: chosen by the client during the handshake, then its pages.
#[derive(Debug)]
pub struct Loan {
    lender: Arc<Lender>,
    /// The borrowing agent.
    from: String,
    opened: OnceLock<Opened>,
    /// Why the client's last request for an export was refused.
    refused: Mutex<Option<String>>,
    /// The client said goodbye (NBD_CMD_DISC): the loan ends with this connection.
    clean: std::sync::atomic::AtomicBool,
}

#[derive(Debug)]
struct Opened {
    export: Export,
    key: Key,
    attachment: u64,
    pages: Pages,
}

impl Drop for Loan {
    fn drop(&mut self) {
        if let Some(o) = self.opened.get() {
            let clean = self.clean.load(std::sync::atomic::Ordering::Relaxed);
            self.lender.close(&o.key, o.attachment, clean);
        }
    }
}

impl Loan {
    pub fn new(lender: Arc<Lender>, from: String) -> Arc<Loan> {
        Arc::new(Loan {
            lender,
            from,
            opened: OnceLock::new(),
            refused: Mutex::default(),
            clean: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The client disconnected cleanly: the loan ends when this connection does.
    pub fn disconnected(&self) {
        self.clean.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The bytes its pages hold now.
    pub fn resident(&self) -> u64 {
        self.opened.get().map_or(0, |o| {
            o.pages.lock().expect("pages lock").len() as u64 * PAGE
        })
    }

    fn opened(&self) -> Result<&Opened, u32> {
        self.opened.get().ok_or(EIO)
    }

    /// Why no export was opened, when the client asked for one that was refused. QEMU's NBD
    /// client keeps the server's reason to itself ("Requested export not available"); the
    /// tunnel gives it to the borrowing agent.
    pub fn refusal(&self) -> Option<String> {
        match self.opened.get() {
            Some(_) => None,
            None => self.refused.lock().expect("refused lock").clone(),
        }
    }
}

impl Exports for Loan {
    async fn find(&self, name: &str) -> Result<Export, String> {
        if let Some(o) = self.opened.get() {
            // NBD_OPT_INFO then NBD_OPT_GO ask twice for the same export.
            return if o.export.name == name {
                Ok(o.export.clone())
            } else {
                Err(format!("this connection serves {:?}", o.export.name))
            };
        }
        let opened = parse_export_name(name).and_then(|(domain, size)| {
            let key = (self.from.clone(), domain.to_owned());
            let (pages, attachment) = self.lender.open(&key, size)?;
            let export = Export {
                name: name.to_owned(),
                size,
                write_zeroes: true,
            };
            Ok(Opened {
                export,
                key,
                attachment,
                pages,
            })
        });
        let opened = opened.inspect_err(|why| {
            *self.refused.lock().expect("refused lock") = Some(why.clone());
        })?;
        let export = opened.export.clone();
        self.opened
            .set(opened)
            .map_err(|_| "the export was opened twice at once".to_owned())?;
        Ok(export)
    }

    fn names(&self) -> Vec<String> {
        // Exports are made on request; none is listed.
        Vec::new()
    }
}

impl Opened {
    fn check(&self, offset: u64, len: u64) -> Result<(), u32> {
        match offset.checked_add(len) {
            Some(end) if end <= self.export.size => Ok(()),
            _ => Err(EINVAL),
        }
    }

    /// Calls `each(page, start in page, range in data)` for every page `offset..offset+len`
    /// touches.
    fn pages_of(offset: u64, len: u64, mut each: impl FnMut(u64, usize, std::ops::Range<usize>)) {
        let mut at = offset;
        while at < offset + len {
            let page = at / PAGE;
            let within = at % PAGE;
            let n = (PAGE - within).min(offset + len - at);
            let from = usize::try_from(at - offset).expect("request lengths fit usize");
            let to = from + usize::try_from(n).expect("at most a page");
            each(
                page,
                usize::try_from(within).expect("below a page"),
                from..to,
            );
            at += n;
        }
    }

    /// Zeroes a range: whole pages are dropped, partial ones cleared.
    fn zero(&self, offset: u64, len: u64) {
        let mut pages = self.pages.lock().expect("pages lock");
        Opened::pages_of(offset, len, |page, within, range| {
            if range.len() as u64 == PAGE {
                pages.remove(&page);
            } else if let Some(p) = pages.get_mut(&page) {
                p[within..within + range.len()].fill(0);
            }
        });
    }
}

impl Blocks for Loan {
    async fn write(&self, offset: u64, data: Bytes) -> Result<(), u32> {
        let o = self.opened()?;
        o.check(offset, data.len() as u64)?;
        let mut pages = o.pages.lock().expect("pages lock");
        Opened::pages_of(offset, data.len() as u64, |page, within, range| {
            let p = pages
                .entry(page)
                .or_insert_with(|| vec![0u8; PAGE_BYTES].into_boxed_slice());
            p[within..within + range.len()].copy_from_slice(&data[range]);
        });
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u64, _may_trim: bool) -> Result<(), u32> {
        let o = self.opened()?;
        o.check(offset, len)?;
        o.zero(offset, len);
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u64) -> Result<(), u32> {
        // The guest's swap discards slots it freed: their pages come back to this host.
        self.write_zeroes(offset, len, true).await
    }

    async fn flush(&self) -> Result<(), u32> {
        // RAM: nothing to make durable.
        self.opened().map(drop)
    }

    async fn read(&self, offset: u64, len: u32) -> Result<Bytes, u32> {
        let o = self.opened()?;
        o.check(offset, u64::from(len))?;
        let mut out = vec![0u8; len as usize];
        let pages = o.pages.lock().expect("pages lock");
        Opened::pages_of(offset, u64::from(len), |page, within, range| {
            if let Some(p) = pages.get(&page) {
                out[range.clone()].copy_from_slice(&p[within..within + range.len()]);
            }
        });
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_loan_reserves_its_size_within_the_limit_and_gives_it_back() {
        let lender = Lender::new(96 << 20);
        let a = Loan::new(lender.clone(), "site-a".into());
        assert_eq!(a.find("vm1:64").await.unwrap().size, 64 << 20);
        // The same name again on this connection (NBD_OPT_INFO, then NBD_OPT_GO).
        assert!(a.find("vm1:64").await.is_ok());
        assert_eq!(lender.lent(), 64 << 20);
        let b = Loan::new(lender.clone(), "site-a".into());
        let e = b.find("vm2:64").await.unwrap_err();
        assert!(e.contains("32 MiB left to lend of its 96 MiB"), "{e}");
        assert!(b
            .find("vm1:16")
            .await
            .unwrap_err()
            .contains("already has swap"));
        a.disconnected();
        drop(a);
        assert_eq!(lender.lent(), 0);
        assert!(b.find("vm2:64").await.is_ok());
    }

    #[tokio::test]
    async fn a_broken_connection_keeps_the_pages_for_the_borrower_to_come_back() {
        let lender = Lender::new(1 << 30);
        let first = Loan::new(lender.clone(), "site-a".into());
        first.find("vm:1").await.unwrap();
        first
            .write(8192, Bytes::from_static(b"swapped"))
            .await
            .unwrap();
        drop(first);
        // Kept, and refused to anyone asking for another size.
        assert_eq!(lender.lent(), 1 << 20);
        let other = Loan::new(lender.clone(), "site-a".into());
        assert!(other.find("vm:2").await.unwrap_err().contains("has 1 MiB"));
        let back = Loan::new(lender.clone(), "site-a".into());
        back.find("vm:1").await.unwrap();
        assert_eq!(&back.read(8192, 7).await.unwrap()[..], b"swapped");
        back.disconnected();
        drop(back);
        assert_eq!(lender.lent(), 0);
    }

    #[tokio::test]
    async fn bad_names_and_an_agent_that_lends_nothing_are_refused_by_name() {
        let none = Loan::new(Lender::new(0), "p".into());
        assert!(none.find("vm:1").await.unwrap_err().contains("lend_mib"));
        let some = Loan::new(Lender::new(1 << 30), "p".into());
        for bad in ["vm", "vm:", ":4", "vm:0", "vm:x", "vm:99999999999"] {
            assert!(
                some.find(bad).await.unwrap_err().contains("expected"),
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn pages_hold_what_was_written_and_trims_give_memory_back() {
        let loan = Loan::new(Lender::new(1 << 30), "p".into());
        loan.find("vm:1").await.unwrap();
        assert_eq!(&loan.read(0, 8).await.unwrap()[..], &[0u8; 8]);
        // A write across a page boundary, not page-aligned.
        let data: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
        loan.write(3000, Bytes::from(data.clone())).await.unwrap();
        assert_eq!(loan.resident(), 3 * PAGE);
        assert_eq!(&loan.read(3000, 6000).await.unwrap()[..], &data[..]);
        loan.trim(4096, 4096).await.unwrap();
        assert_eq!(loan.resident(), 2 * PAGE);
        let back = loan.read(3000, 6000).await.unwrap();
        assert_eq!(&back[..1096], &data[..1096]);
        assert!(back[1096..5192].iter().all(|&b| b == 0));
        assert_eq!(&back[5192..], &data[5192..]);
        assert_eq!(loan.read((1 << 20) - 4, 8).await.unwrap_err(), EINVAL);
        assert_eq!(
            loan.write(1 << 20, Bytes::from_static(b"x"))
                .await
                .unwrap_err(),
            EINVAL
        );
    }
}
