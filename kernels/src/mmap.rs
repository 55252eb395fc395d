//! Read-only memory-mapped files, for checkpoints that are far larger than what is worth copying.

use std::fs::File;
use std::path::Path;

/// A file mapped read-only into memory.
#[derive(Debug)]
pub struct MappedFile {
    map: memmap2::Mmap,
}

impl MappedFile {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        // SAFETY: the mapping is read-only and lives as long as `self`. A checkpoint changed or
        // truncated by another process while mapped would change what we read (or fault); model
        // files are treated as immutable while the server runs, as every inference server does.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok(Self { map })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}
