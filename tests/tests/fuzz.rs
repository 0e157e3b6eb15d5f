//! The parsers of everything a user hands us, fed random and mutated input: `.npy` files, PNG
//! images, `config.json` of both families, safetensors checkpoints, and the runtime's wire
//! messages. Each must return a value or a typed error: no panic, no abort, no hang.
//!
//! proptest runs 256 cases per target by default; `cargo xtask fuzz` runs these (and the
//! socket frame target in vae-transport) with `PROPTEST_CASES` set for a long run.

use std::io::Write;

use proptest::prelude::*;
use proptest::sample::Index;
use vae_parallel::io::{npy_bytes, npy_from_bytes, png_from_bytes};
use vae_tensor::{Device, Tensor};

/// One edit of a seed input: overwrite, insert or delete a byte, or cut the input there.
#[derive(Debug, Clone)]
enum Edit {
    Set(Index, u8),
    Insert(Index, u8),
    Delete(Index),
    Truncate(Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        2 => any::<Index>().prop_map(Edit::Delete),
        1 => any::<Index>().prop_map(Edit::Truncate),
    ]
}

/// `seed` with `edits` applied in order.
fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for e in edits {
        if bytes.is_empty() {
            break;
        }
        match e {
            Edit::Set(i, b) => {
                let at = i.index(bytes.len());
                bytes[at] = *b;
            }
            Edit::Insert(i, b) => {
                let at = i.index(bytes.len() + 1);
                bytes.insert(at, *b);
            }
            Edit::Delete(i) => {
                let at = i.index(bytes.len());
                bytes.remove(at);
            }
            Edit::Truncate(i) => {
                let at = i.index(bytes.len());
                bytes.truncate(at);
            }
        }
    }
    bytes
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec(edit(), 1..8)
}

fn seed_npy() -> Vec<u8> {
    let t = Tensor::from_vec((0..24).map(|i| i as f32 / 7.0).collect(), vec![1, 2, 3, 4], &Device::Cpu).unwrap();
    npy_bytes(&t).unwrap()
}

fn seed_png() -> Vec<u8> {
    let mut bytes = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut bytes, 5, 3);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().unwrap();
        writer.write_image_data(&(0..45).map(|i| (i * 5) as u8).collect::<Vec<_>>()).unwrap();
    }
    bytes
}

fn seed_config(family: &str) -> String {
    let dir = vae_integration_tests::fixtures_dir().join(family);
    let model = if family == "wan" { "wan21_like" } else { "sd_like" };
    std::fs::read_to_string(dir.join(model).join("config.json")).unwrap()
}

fn seed_safetensors() -> Vec<u8> {
    let a: Vec<u8> = (0..12).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let b: Vec<u8> = (0..4).flat_map(|i| half::f16::from_f32(i as f32).to_le_bytes()).collect();
    let views = vec![
        (
            "conv.weight".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![3, 4], &a).unwrap(),
        ),
        ("conv.bias".to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![4], &b).unwrap()),
    ];
    safetensors::serialize(views, None).unwrap()
}

/// Opens `bytes` as a one-file checkpoint and takes every tensor its header lists, with the
/// shape the header claims: any outcome but a panic is fine.
fn load_checkpoint(bytes: &[u8], scratch: &std::path::Path) {
    let path = scratch.join("model.safetensors");
    std::fs::File::create(&path).unwrap().write_all(bytes).unwrap();
    let Ok(mut store) = vae_models::weights::WeightStore::open_files(&[path]) else { return };
    let Ok((_, meta)) = safetensors::SafeTensors::read_metadata(bytes) else { return };
    for (name, info) in meta.tensors() {
        if info.shape.iter().product::<usize>() > 1 << 20 {
            continue; // a header that claims a large tensor over a small file: refused either way
        }
        let _ = store.take(&name, &info.shape);
    }
}

fn scratch() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("vae-fuzz-{}-{:?}", std::process::id(), std::thread::current().id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

proptest! {
    #[test]
    fn fuzz_npy_reader(edits in edits(), noise in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = npy_from_bytes(&mutate(&seed_npy(), &edits));
        let _ = npy_from_bytes(&noise);
        let mut headed = b"\x93NUMPY\x01\x00".to_vec();
        headed.extend_from_slice(&noise);
        let _ = npy_from_bytes(&headed);
    }

    #[test]
    fn fuzz_png_reader(edits in edits(), noise in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = png_from_bytes(&mutate(&seed_png(), &edits));
        let _ = png_from_bytes(&noise);
    }

    #[test]
    fn fuzz_config_json(edits in edits(), text in ".{0,200}") {
        for family in ["autoencoder_kl", "wan"] {
            let seed = seed_config(family);
            let mutated = String::from_utf8_lossy(&mutate(seed.as_bytes(), &edits)).into_owned();
            for candidate in [&mutated, &text] {
                let _ = vae_models::autoencoder_kl::AutoencoderKlConfig::from_json(candidate);
                let _ = serde_json::from_str::<vae_models::wan::WanConfig>(candidate);
            }
        }
    }

    #[test]
    fn fuzz_safetensors_checkpoint(edits in edits(), noise in prop::collection::vec(any::<u8>(), 0..128)) {
        let dir = scratch();
        load_checkpoint(&mutate(&seed_safetensors(), &edits), &dir);
        let mut headed = (noise.len() as u64).to_le_bytes().to_vec();
        headed.extend_from_slice(&noise);
        load_checkpoint(&headed, &dir);
    }

    #[test]
    fn fuzz_wire_reader(bytes in prop::collection::vec(any::<u8>(), 0..128), ops in prop::collection::vec(0u8..4, 0..16)) {
        let mut r = vae_transport::wire::Reader::new(&bytes, "fuzz");
        for op in ops {
            let ok = match op {
                0 => r.u8().is_ok(),
                1 => r.u64().is_ok(),
                2 => r.usize().is_ok(),
                _ => r.str().is_ok(),
            };
            if !ok {
                break;
            }
        }
    }
}
