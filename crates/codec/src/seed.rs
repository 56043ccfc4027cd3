//! Seeds: pages the receiving end already holds before the migration starts, in an earlier
//! image of the VM (it ran there before) or of a sibling made from the same template. The
//! receiver indexes its image by content and gives the index to the sender; a page whose
//! content is in the index then travels as a reference to the image's page (a few bytes
//! instead of 4 KiB).
//!
//! The index on the wire, one entry per distinct non-zero page content, in image order:
//!
//! ```text
//! entry := varint gap, 16 bytes     gap: the image page number minus the previous entry's
//!                                        (the first entry's: its page number);
//!                                   then the page's xxh3-128, little endian
//! ```
//!
//! Zero pages are left out (they have their own record). The hash is 128 bits wide, so two
//! different pages with the same hash are out of practical reach; the stream's end-to-end
//! digest (the agents compare SHA-256 of QEMU's bytes) would still catch one.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::page::is_zero;
use crate::{varint, CodecError, PAGE_SIZE};

const ENTRY_HASH_BYTES: usize = 16;

/// The most bytes an honest index of an image of `image_bytes` takes (one entry a page).
pub fn max_index_bytes(image_bytes: u64) -> u64 {
    (image_bytes / PAGE_SIZE as u64).saturating_mul(varint::MAX_BYTES + ENTRY_HASH_BYTES as u64)
}

/// A page's content hash, as the index and the lookup compute it.
pub fn content_hash(page: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(page)
}

/// Indexes `image` (whole pages; a partial last page is ignored) and returns the index's wire
/// bytes and how many entries it holds.
pub fn index_image(image: &[u8]) -> (Vec<u8>, u64) {
    let mut seen = FxHashMap::default();
    let mut out = Vec::new();
    let mut previous = 0u64;
    for (n, page) in image.chunks_exact(PAGE_SIZE).enumerate() {
        if is_zero(page) {
            continue;
        }
        let hash = content_hash(page);
        if seen.insert(hash, ()).is_some() {
            continue;
        }
        let n = n as u64;
        varint::put(&mut out, n - previous);
        out.extend_from_slice(&hash.to_le_bytes());
        previous = n;
    }
    let entries = seen.len() as u64;
    (out, entries)
}

/// The sender's view of the receiver's image: content hash to image page number.
#[derive(Debug, Default)]
pub struct SeedIndex {
    pages: FxHashMap<u128, u64>,
}

impl SeedIndex {
    /// Reads an index made by [`index_image`].
    pub fn parse(mut input: &[u8]) -> Result<SeedIndex, CodecError> {
        let mut pages = FxHashMap::default();
        let mut page = 0u64;
        while !input.is_empty() {
            let gap = varint::get(&mut input)?;
            page = page
                .checked_add(gap)
                .ok_or(CodecError::BadSeedIndex("page number overflows"))?;
            if input.len() < ENTRY_HASH_BYTES {
                return Err(CodecError::Truncated("seed index entry"));
            }
            let (hash, rest) = input.split_at(ENTRY_HASH_BYTES);
            input = rest;
            let hash = u128::from_le_bytes(hash.try_into().expect("16 bytes"));
            pages.entry(hash).or_insert(page);
        }
        Ok(SeedIndex { pages })
    }

    /// The image page holding exactly `page`'s content, if the index has it.
    pub fn find(&self, page: &[u8]) -> Option<u64> {
        self.pages.get(&content_hash(page)).copied()
    }

    /// Distinct page contents the index names.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
}

/// The receiver's image, whole pages; a reference names one of them. Any byte container will
/// do (a vector, a file mapped into memory); it must not change while the decoder uses it.
/// Clones share the bytes (the shards of one stream each hold one).
#[derive(Default, Clone)]
pub struct SeedImage {
    bytes: Option<Arc<dyn AsRef<[u8]> + Send + Sync>>,
}

impl std::fmt::Debug for SeedImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SeedImage({} bytes)", self.as_bytes().len())
    }
}

impl SeedImage {
    pub fn new(bytes: impl AsRef<[u8]> + Send + Sync + 'static) -> SeedImage {
        SeedImage {
            bytes: Some(Arc::new(bytes)),
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.bytes.as_ref().map_or(&[], |b| (**b).as_ref())
    }

    /// Image page `n`.
    pub fn page(&self, n: u64) -> Result<&[u8], CodecError> {
        let bytes = self.as_bytes();
        let start = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(PAGE_SIZE))
            .filter(|s| s + PAGE_SIZE <= bytes.len())
            .ok_or(CodecError::NoSeedPage(n))?;
        Ok(&bytes[start..start + PAGE_SIZE])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_index_fits_its_announced_bound() {
        let image = crate::disk_base::tests::distinct_blocks(500 * PAGE_SIZE);
        let (index, entries) = index_image(&image);
        assert_eq!(entries, 500);
        assert!(index.len() as u64 <= max_index_bytes(image.len() as u64));
    }

    fn page(fill: u8) -> Vec<u8> {
        let mut p = vec![fill; PAGE_SIZE];
        p[7] = fill.wrapping_add(1);
        p
    }

    #[test]
    fn the_index_names_each_distinct_nonzero_page_once() {
        let mut image = Vec::new();
        for p in [page(1), vec![0; PAGE_SIZE], page(2), page(1), page(3)] {
            image.extend_from_slice(&p);
        }
        image.extend_from_slice(&[9; 100]); // a partial page is ignored
        let (bytes, entries) = index_image(&image);
        assert_eq!(entries, 3);
        let index = SeedIndex::parse(&bytes).unwrap();
        assert_eq!(index.len(), 3);
        assert_eq!(index.find(&page(1)), Some(0));
        assert_eq!(index.find(&page(2)), Some(2));
        assert_eq!(index.find(&page(3)), Some(4));
        assert_eq!(index.find(&page(4)), None);
        assert_eq!(index.find(&[0; PAGE_SIZE]), None);
        let seed = SeedImage::new(image);
        assert_eq!(seed.page(4).unwrap(), &page(3)[..]);
        assert_eq!(seed.page(5), Err(CodecError::NoSeedPage(5)));
        assert_eq!(seed.page(u64::MAX), Err(CodecError::NoSeedPage(u64::MAX)));
    }

    #[test]
    fn a_damaged_index_is_an_error() {
        let (bytes, _) = index_image(&page(1));
        assert!(SeedIndex::parse(&bytes[..bytes.len() - 1]).is_err());
        let mut overflow = Vec::new();
        varint::put(&mut overflow, u64::MAX);
        overflow.extend_from_slice(&[0; 16]);
        varint::put(&mut overflow, 1);
        overflow.extend_from_slice(&[1; 16]);
        assert!(SeedIndex::parse(&overflow).is_err());
    }
}
