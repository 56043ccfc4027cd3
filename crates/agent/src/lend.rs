//! Memory lent to peers' VMs as swap: Overdriver's cooperative swap (Williams et al.), where a
//! host in a transient overload pages its VMs out to peers' spare memory instead of migrating
//! them. This is the lending side: a peer's swap tunnel ([`TunnelKind::Swap`]) reaches an NBD
//! server here whose export lives in this agent's RAM, within `[host] lend_mib` for all loans
//! together. The borrowing side is [`crate::borrow`].
//!
//! The export QEMU asks for is named `<domain>:<MiB>`: the borrower's domain and the swap's
//! size. The whole size is reserved when the export is opened (the spare memory a capacity
//! planner sized, not what happens to be free at a burst's peak); pages are allocated only when
//! written, and a trimmed or zeroed range gives its pages back. The loan ends with its
//! connection: the borrower releases it only after the guest swapped its pages back in.
//!
//! [`TunnelKind::Swap`]: crate::engine::control::TunnelKind::Swap

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use ferry_qemu::nbd::proto::{EINVAL, EIO};
use ferry_qemu::nbd::{Blocks, Export, Exports};

/// The unit pages are kept in: the guest's page, what its swap writes.
const PAGE_BYTES: usize = 4096;
const PAGE: u64 = PAGE_BYTES as u64;
/// The largest swap one loan may be (a bound on a peer's request before anything else).
pub const MAX_LOAN_BYTES: u64 = 1 << 40;

/// This host's memory for loans, and what is lent now.
#[derive(Debug)]
pub struct Lender {
    limit: u64,
    /// Reserved bytes by (borrowing agent, domain).
    lent: Mutex<HashMap<(String, String), u64>>,
}

impl Lender {
    pub fn new(limit_bytes: u64) -> Arc<Lender> {
        Arc::new(Lender {
            limit: limit_bytes,
            lent: Mutex::default(),
        })
    }

    /// The bytes lent now.
    pub fn lent(&self) -> u64 {
        self.lent.lock().expect("lent lock").values().sum()
    }

    /// Reserves `bytes` for `domain` of agent `from`, or says why not (the borrower's QEMU
    /// is told, and with it the user who asked).
    fn reserve(
        self: &Arc<Self>,
        from: &str,
        domain: &str,
        bytes: u64,
    ) -> Result<Reservation, String> {
        let mut lent = self.lent.lock().expect("lent lock");
        let key = (from.to_owned(), domain.to_owned());
        if lent.contains_key(&key) {
            return Err(format!("{from}'s domain {domain:?} already has swap here"));
        }
        let used: u64 = lent.values().sum();
        let free = self.limit.saturating_sub(used);
        if bytes > free {
            return Err(if self.limit == 0 {
                "this agent lends no memory ([host] lend_mib in its config)".to_owned()
            } else {
                format!(
                    "this agent has {} MiB left to lend of its {} MiB, not {} MiB",
                    free >> 20,
                    self.limit >> 20,
                    bytes >> 20
                )
            });
        }
        lent.insert(key.clone(), bytes);
        Ok(Reservation {
            lender: self.clone(),
            key,
        })
    }
}

/// One loan's reservation, given back when dropped.
#[derive(Debug)]
struct Reservation {
    lender: Arc<Lender>,
    key: (String, String),
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.lender
            .lent
            .lock()
            .expect("lent lock")
            .remove(&self.key);
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
}

#[derive(Debug)]
struct Opened {
    export: Export,
    pages: Mutex<HashMap<u64, Box<[u8]>>>,
    _reservation: Reservation,
}

impl Loan {
    pub fn new(lender: Arc<Lender>, from: String) -> Arc<Loan> {
        Arc::new(Loan {
            lender,
            from,
            opened: OnceLock::new(),
            refused: Mutex::default(),
        })
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
        let reserved = parse_export_name(name).and_then(|(domain, size)| {
            Ok((domain, size, self.lender.reserve(&self.from, domain, size)?))
        });
        let (domain, size, reservation) = reserved.inspect_err(|why| {
            *self.refused.lock().expect("refused lock") = Some(why.clone());
        })?;
        let export = Export {
            name: name.to_owned(),
            size,
        };
        let opened = Opened {
            export: export.clone(),
            pages: Mutex::default(),
            _reservation: reservation,
        };
        self.opened
            .set(opened)
            .map_err(|_| "the export was opened twice at once".to_owned())?;
        tracing::info!(
            "lending {} MiB to {}'s domain {domain:?}",
            size >> 20,
            self.from
        );
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
        drop(a);
        assert_eq!(lender.lent(), 0);
        assert!(b.find("vm2:64").await.is_ok());
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
