use super::*;
use crate::calibrate::{train_codec, KMeansConfig};
use crate::testing::{outlier_rows, rng};
use std::path::PathBuf;

fn identity() -> ModelIdentity {
    ModelIdentity { name: "tiny".into(), architecture: "llama".into(), n_layers: 2, n_kv_heads: 2, head_dim: 32 }
}

fn calibration() -> Calibration {
    let model = identity();
    let keys = CodecSpec::keys(PqShape::new(4, 5).unwrap());
    let values = CodecSpec { granularity: Granularity::PerSubspace, ..CodecSpec::values(PqShape::new(8, 4).unwrap()) };
    let mut r = rng(11);
    let layers = (0..2)
        .map(|_| {
            let x = outlier_rows(&mut r, 200 * 2, 32);
            let (k, _) = train_codec(&x, 2, 32, &keys, &KMeansConfig::new(32, 1)).unwrap();
            let (v, _) = train_codec(&x, 2, 32, &values, &KMeansConfig::new(16, 2)).unwrap();
            LayerCodecs { keys: k, values: v }
        })
        .collect();
    let text = TextFingerprint::of_tokens(&(0..200u32).map(|i| i * 7 % 101).collect::<Vec<_>>());
    Calibration::new(model, keys, values, 1, 200, layers).unwrap().with_text(text)
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("veloq-artifact-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Re-serializes `bytes` with `edit` applied to each tensor (name, dtype, shape, data) and the
/// metadata JSON passed through `meta`.
fn rewrite(
    bytes: &[u8],
    edit: impl Fn(&str, &mut Dtype, &mut Vec<usize>, &mut Vec<u8>) -> bool,
    meta: impl Fn(String) -> String,
) -> Vec<u8> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(bytes).unwrap();
    let json = meta(header.metadata().as_ref().unwrap()["veloq"].clone());
    let mut owned = Vec::new();
    for (name, t) in st.tensors() {
        let (mut dt, mut shape, mut data) = (t.dtype(), t.shape().to_vec(), t.data().to_vec());
        if edit(&name, &mut dt, &mut shape, &mut data) {
            owned.push((name, dt, shape, data));
        }
    }
    let views: Vec<_> =
        owned.iter().map(|(n, dt, s, d)| (n.clone(), TensorView::new(*dt, s.clone(), d).unwrap())).collect();
    safetensors::serialize(views, Some(HashMap::from([("veloq".to_string(), json)]))).unwrap()
}

fn load_err(bytes: &[u8]) -> String {
    Calibration::from_bytes(bytes, Path::new("test.safetensors")).unwrap_err().to_string()
}

#[test]
fn round_trip_and_deterministic_bytes() {
    let cal = calibration();
    let path = tmp("rt.safetensors");
    cal.save(&path).unwrap();
    assert_eq!(Calibration::load(&path).unwrap(), cal);
    assert_eq!(Calibration::load_for(&path, &identity()).unwrap(), cal);
    assert_eq!(std::fs::read(&path).unwrap(), calibration().to_bytes().unwrap());
    let bpe = cal.bits_per_element(1 << 20);
    assert!(bpe > 0.5 * (1.25 + 0.5) && bpe < 0.5 * (1.25 + 0.5) + 0.01, "{bpe}");
}

/// Attention-weighted value books are recorded and read back; uniform ones leave the metadata as
/// artifacts from before the option had it (no key), and such an artifact reads as uniform; a
/// name this veloq does not know is refused.
#[test]
fn value_weights_round_trip() {
    let cal = calibration().with_value_weights(ValueWeights::Attention);
    let bytes = cal.to_bytes().unwrap();
    assert_eq!(Calibration::from_bytes(&bytes, Path::new("w.safetensors")).unwrap(), cal);
    let json = |b: &[u8]| SafeTensors::read_metadata(b).unwrap().1.metadata().as_ref().unwrap()["veloq"].clone();
    assert!(json(&bytes).contains("\"value_weights\":\"attention\""));
    assert!(!json(&calibration().to_bytes().unwrap()).contains("value_weights"));
    let unknown = rewrite(&bytes, |_, _, _, _| true, |m| m.replace("\"attention\"", "\"loud\""));
    assert!(load_err(&unknown).contains("value weights \"loud\""), "{}", load_err(&unknown));
}

#[test]
fn rejects_wrong_geometry() {
    let path = tmp("geo.safetensors");
    calibration().save(&path).unwrap();
    for other in [
        ModelIdentity { n_layers: 3, ..identity() },
        ModelIdentity { head_dim: 64, ..identity() },
        ModelIdentity { n_kv_heads: 4, ..identity() },
        ModelIdentity { architecture: "gemma3".into(), ..identity() },
    ] {
        let e = Calibration::load_for(&path, &other).unwrap_err().to_string();
        assert!(e.contains("calibrated for tiny"), "{e}");
    }
    // Metadata claims a geometry the tensors do not have.
    let bytes = calibration().to_bytes().unwrap();
    let lie = |m: String| {
        let m = m.replace("\"head_dim\":32", "\"head_dim\":64");
        let hash = ModelIdentity { head_dim: 64, ..identity() }.geometry_hash();
        m.replace(&identity().geometry_hash(), &hash)
    };
    let e = load_err(&rewrite(&bytes, |_, _, _, _| true, lie));
    assert!(e.contains("shape") && e.contains("expected"), "{e}");
    let e = load_err(&rewrite(&bytes, |_, _, _, _| true, |m| m.replace("\"n_layers\":2", "\"n_layers\":3")));
    assert!(e.contains("geometry hash"), "{e}");
}

#[test]
fn rejects_non_finite_values() {
    let bytes = calibration().to_bytes().unwrap();
    for (target, value) in [
        ("layers.1.keys.codebooks", f32::NAN),
        ("layers.0.values.codebooks", f32::INFINITY),
        ("layers.0.keys.smooth", f32::NAN),
    ] {
        let poisoned = rewrite(
            &bytes,
            |name, _, _, data| {
                if name == target {
                    data[12..16].copy_from_slice(&value.to_le_bytes());
                }
                true
            },
            |m| m,
        );
        let e = load_err(&poisoned);
        assert!(e.contains("non-finite") && e.contains(target), "{e}");
    }
    let zero_scale = rewrite(
        &bytes,
        |name, _, _, data| {
            if name == "layers.0.keys.smooth" {
                data[..4].copy_from_slice(&0.0f32.to_le_bytes());
            }
            true
        },
        |m| m,
    );
    assert!(load_err(&zero_scale).contains("below"));
}

#[test]
fn rejects_truncated_and_corrupt_files() {
    let bytes = calibration().to_bytes().unwrap();
    for cut in [0, 4, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        let e = load_err(&bytes[..cut]);
        assert!(e.contains("truncated or corrupt"), "cut {cut}: {e}");
    }
    let mut garbage = bytes.clone();
    garbage[9] = b'#';
    assert!(load_err(&garbage).contains("truncated or corrupt"));
    let e = Calibration::load(tmp("does-not-exist.safetensors")).unwrap_err().to_string();
    assert!(e.contains("does-not-exist"), "{e}");
}

#[test]
fn rejects_wrong_dtype_missing_and_extra_tensors() {
    let bytes = calibration().to_bytes().unwrap();
    let as_f16 = rewrite(
        &bytes,
        |name, dt, _, data| {
            if name == "layers.0.keys.codebooks" {
                *dt = Dtype::F16;
                let halves: Vec<u8> = data
                    .chunks_exact(4)
                    .flat_map(|b| half::f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
                    .collect();
                *data = halves;
            }
            true
        },
        |m| m,
    );
    let e = load_err(&as_f16);
    assert!(e.contains("dtype F16, expected F32"), "{e}");
    let missing = rewrite(&bytes, |name, _, _, _| name != "layers.1.values.codebooks", |m| m);
    assert!(load_err(&missing).contains("missing tensor layers.1.values.codebooks"));
    let no_meta = rewrite(&bytes, |_, _, _, _| true, |m| m.replace("veloq.vecinfer", "other"));
    assert!(load_err(&no_meta).contains("format other"));
    let bad_bits = rewrite(&bytes, |_, _, _, _| true, |m| m.replace("\"bits\":5", "\"bits\":13"));
    assert!(load_err(&bad_bits).contains("codebook_bits 13"));
}
