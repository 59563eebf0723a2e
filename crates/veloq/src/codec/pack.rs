//! Bit packing of codebook indices: `bits`-wide codes stored back to back, least significant bit
//! first, so stored bytes equal the nominal rate (12-bit codes take 1.5 bytes, not 4).

use crate::error::{Error, Result};

/// Widest supported code.
pub const MAX_BITS: u32 = 16;

/// Bytes needed for `count` codes of `bits` bits.
#[inline]
pub fn packed_len(count: usize, bits: u32) -> usize {
    (count * bits as usize).div_ceil(8)
}

fn check_bits(bits: u32) -> Result<()> {
    if bits == 0 || bits > MAX_BITS {
        return Err(Error::Config(format!("code width {bits} outside 1..={MAX_BITS} bits")));
    }
    Ok(())
}

/// Packs `codes` into `out` (exactly [`packed_len`] bytes). Codes must fit in `bits`.
pub fn pack(codes: &[u16], bits: u32, out: &mut [u8]) -> Result<()> {
    check_bits(bits)?;
    if out.len() != packed_len(codes.len(), bits) {
        return Err(Error::Shape(format!(
            "pack: {} codes of {bits} bits need {} bytes, got {}",
            codes.len(),
            packed_len(codes.len(), bits),
            out.len()
        )));
    }
    if let Some(&c) = codes.iter().find(|&&c| bits < 16 && (c as u32) >> bits != 0) {
        return Err(Error::Config(format!("pack: code {c} does not fit in {bits} bits")));
    }
    pack_unchecked(codes, bits, out);
    Ok(())
}

/// [`pack`] without validation, for kernels whose codes come from a codebook of `2^bits` entries.
#[inline]
pub fn pack_unchecked(codes: &[u16], bits: u32, out: &mut [u8]) {
    if bits == 8 {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = c as u8;
        }
        return;
    }
    let mut acc: u64 = 0;
    let mut filled = 0u32;
    let mut pos = 0;
    for &c in codes {
        acc |= (c as u64) << filled;
        filled += bits;
        while filled >= 8 {
            out[pos] = acc as u8;
            pos += 1;
            acc >>= 8;
            filled -= 8;
        }
    }
    if filled > 0 {
        out[pos] = acc as u8;
    }
}

/// Unpacks `out.len()` codes of `bits` bits from `packed`.
pub fn unpack(packed: &[u8], bits: u32, out: &mut [u16]) -> Result<()> {
    check_bits(bits)?;
    if packed.len() < packed_len(out.len(), bits) {
        return Err(Error::Shape(format!(
            "unpack: {} codes of {bits} bits need {} bytes, got {}",
            out.len(),
            packed_len(out.len(), bits),
            packed.len()
        )));
    }
    unpack_unchecked(packed, bits, out);
    Ok(())
}

/// [`unpack`] without validation.
#[inline]
pub fn unpack_unchecked(packed: &[u8], bits: u32, out: &mut [u16]) {
    if bits == 8 {
        for (o, &b) in out.iter_mut().zip(packed) {
            *o = b as u16;
        }
        return;
    }
    let mask = (1u64 << bits) - 1;
    let mut acc: u64 = 0;
    let mut filled = 0u32;
    let mut bytes = packed.iter();
    for o in out.iter_mut() {
        while filled < bits {
            acc |= (*bytes.next().expect("length checked") as u64) << filled;
            filled += 8;
        }
        *o = (acc & mask) as u16;
        acc >>= bits;
        filled -= bits;
    }
}

/// The code at position `index` of a packed stream, without unpacking the rest.
#[inline]
pub fn get(packed: &[u8], bits: u32, index: usize) -> u16 {
    if bits == 8 {
        return packed[index] as u16;
    }
    let bit = index * bits as usize;
    let (byte, shift) = (bit / 8, bit % 8);
    let mut word = 0u32;
    for k in 0..3 {
        if let Some(&b) = packed.get(byte + k) {
            word |= (b as u32) << (8 * k);
        }
    }
    ((word >> shift) & ((1u32 << bits) - 1)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nominal_sizes() {
        assert_eq!(packed_len(16, 8), 16);
        assert_eq!(packed_len(16, 12), 24);
        assert_eq!(packed_len(3, 4), 2);
        assert_eq!(packed_len(0, 12), 0);
    }

    #[test]
    fn rejects_bad_arguments() {
        let mut out = [0u8; 2];
        assert!(pack(&[16], 4, &mut out[..1]).is_err());
        assert!(pack(&[1, 2], 4, &mut out).is_err());
        assert!(pack(&[1], 0, &mut out[..0]).is_err());
        assert!(unpack(&out[..1], 12, &mut [0u16; 1]).is_err());
    }

    proptest! {
        #[test]
        fn round_trip(bits in 1u32..=16, raw in prop::collection::vec(any::<u16>(), 0..300)) {
            let codes: Vec<u16> = raw.iter().map(|c| if bits == 16 { *c } else { c & ((1 << bits) - 1) }).collect();
            let mut packed = vec![0u8; packed_len(codes.len(), bits)];
            pack(&codes, bits, &mut packed).unwrap();
            let mut back = vec![0u16; codes.len()];
            unpack(&packed, bits, &mut back).unwrap();
            prop_assert_eq!(&back, &codes);
            for (i, &c) in codes.iter().enumerate() {
                prop_assert_eq!(get(&packed, bits, i), c);
            }
        }

        /// Packing in byte-aligned pieces equals packing the whole stream: kernels rely on this to
        /// write disjoint byte ranges from several threads.
        #[test]
        fn aligned_pieces_concatenate(bits in 1u32..=16, pieces in 1usize..6, raw in prop::collection::vec(any::<u16>(), 8..64)) {
            let codes: Vec<u16> = raw.iter().map(|c| if bits == 16 { *c } else { c & ((1 << bits) - 1) }).collect();
            let piece = 8 * codes.len().div_ceil(8 * pieces);
            let mut whole = vec![0u8; packed_len(codes.len(), bits)];
            pack(&codes, bits, &mut whole).unwrap();
            let mut joined = Vec::new();
            for chunk in codes.chunks(piece) {
                let mut p = vec![0u8; packed_len(chunk.len(), bits)];
                pack(chunk, bits, &mut p).unwrap();
                joined.extend(p);
            }
            prop_assert_eq!(joined, whole);
        }
    }
}
