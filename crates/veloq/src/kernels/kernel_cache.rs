//! Compiled GPU kernels kept on disk, so that a second process starts warm: NVRTC takes seconds
//! for each kernel variant a model needs, and every process used to compile them all again. A
//! file is named by a hash of everything its text depends on — the kernel's source with its
//! `#define`s, its name, the architecture and the compiler's version — so a change anywhere
//! compiles afresh, and a file that is unreadable or does not load is compiled again and replaced.
//! Files hold machine code (`.cubin`), which loads without the driver's translation.
//! Device-free (file and hash logic only), so it is tested without a GPU. The directory comes
//! from [`KernelOptions::kernel_cache`](super::KernelOptions::kernel_cache).

use std::path::Path;

/// The file name for `parts`: two FNV-1a 64-bit hashes (different offsets) over the parts and
/// their lengths, as 32 hex digits. Stable across builds and platforms (unlike `std`'s hasher).
pub fn key(parts: &[&str]) -> String {
    let fnv = |offset: u64| {
        let mut h = offset;
        for p in parts {
            for b in (p.len() as u64).to_le_bytes().iter().chain(p.as_bytes()) {
                h ^= *b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        h
    };
    format!("{:016x}{:016x}", fnv(0xcbf2_9ce4_8422_2325), fnv(0x6c62_272e_07bb_0142))
}

fn path(dir: &Path, key: &str) -> std::path::PathBuf {
    dir.join(format!("{key}.cubin"))
}

/// The cached code for `key`, if a complete file is there.
pub fn load(dir: &Path, key: &str) -> Option<Vec<u8>> {
    let code = std::fs::read(path(dir, key)).ok()?;
    // A file is written whole and renamed into place; an empty one is not a kernel.
    (!code.is_empty()).then_some(code)
}

/// Keeps `code` under `key`: written to a temporary file and renamed, so that concurrent
/// processes never read half a file. A cache that cannot be written only costs the next process
/// a compile: errors are returned for the caller to ignore or report.
pub fn store(dir: &Path, key: &str, code: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{key}.cubin.{}.tmp", std::process::id()));
    std::fs::write(&tmp, code)?;
    std::fs::rename(&tmp, path(dir, key))
}

/// Drops the file for `key` (it did not load).
pub fn forget(dir: &Path, key: &str) {
    let _ = std::fs::remove_file(path(dir, key));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_change_with_every_part_and_with_where_parts_split() {
        let base = key(&["sm_90", "vq_attend", "#define D 64\nsrc", "13.0"]);
        assert_eq!(base.len(), 32);
        assert_eq!(base, key(&["sm_90", "vq_attend", "#define D 64\nsrc", "13.0"]), "deterministic");
        for other in [
            key(&["sm_80", "vq_attend", "#define D 64\nsrc", "13.0"]),
            key(&["sm_90", "vq_attendx", "#define D 64\nsrc", "13.0"]),
            key(&["sm_90", "vq_attend", "#define D 128\nsrc", "13.0"]),
            key(&["sm_90", "vq_attend", "#define D 64\nsrc", "13.1"]),
            key(&["sm_90", "vq_atten", "d#define D 64\nsrc", "13.0"]),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn stores_loads_and_forgets() {
        let dir = std::env::temp_dir().join(format!("veloq-kernel-cache-test-{}", std::process::id()));
        let k = key(&["a", "b"]);
        assert_eq!(load(&dir, &k), None, "nothing before a store");
        let code = b"\x7fELF\x02\x01\x01\x33\0\0 machine code with a NUL";
        store(&dir, &k, code).unwrap();
        assert_eq!(load(&dir, &k).as_deref(), Some(&code[..]), "bytes come back whole, NULs included");
        std::fs::write(path(&dir, &k), b"").unwrap();
        assert_eq!(load(&dir, &k), None, "an empty file is no kernel");
        forget(&dir, &k);
        assert!(!path(&dir, &k).exists());
        let leftovers = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(leftovers, 0, "no temporary files left");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
