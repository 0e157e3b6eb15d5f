//! Tensor files: `.npy` (read and write, f32 little-endian C order; f64/f16 read as f32),
//! `.safetensors` (read: a file holding one tensor), and PNG images with diffusers' pre- and
//! post-processing. Outputs are written atomically: a temporary sibling, then a rename.

use crate::output::Staged;
use std::path::{Path, PathBuf};

use vae_tensor::{Device, SafetensorsError, Tensor};

/// Errors of reading or writing tensor files.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The OS refused.
    #[error("{path}: {source}")]
    Os {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not in the format its name says.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor that cannot be written in the requested format.
    #[error("{0}")]
    Unsupported(String),
    /// Bytes (not from a file) that are not a valid file of their format.
    #[error("{0}")]
    Malformed(String),
}

fn format_err(path: &Path, message: impl Into<String>) -> IoError {
    IoError::Format { path: path.to_path_buf(), message: message.into() }
}

fn os_err(path: &Path) -> impl FnOnce(std::io::Error) -> IoError + '_ {
    move |source| IoError::Os { path: path.to_path_buf(), source }
}

/// Reads a tensor from `.npy` or `.safetensors` (by extension).
pub fn read_tensor(path: impl AsRef<Path>) -> Result<Tensor, IoError> {
    let path = path.as_ref();
    match extension(path).as_str() {
        "npy" => read_npy(path),
        "safetensors" => read_safetensors(path),
        other => Err(format_err(path, format!("unsupported tensor file type {other:?} (use .npy or .safetensors)"))),
    }
}

fn extension(path: &Path) -> String {
    path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase()
}

/// Reads a `.npy` array of f32 (also f64 and f16, converted), little-endian, C order.
pub fn read_npy(path: impl AsRef<Path>) -> Result<Tensor, IoError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(os_err(path))?;
    parse_npy(&bytes).map_err(|m| format_err(path, m))
}

/// [`read_npy`] of a file's bytes in memory.
pub fn npy_from_bytes(bytes: &[u8]) -> Result<Tensor, IoError> {
    parse_npy(bytes).map_err(IoError::Malformed)
}

fn parse_npy(bytes: &[u8]) -> Result<Tensor, String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (bad magic)".into());
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let header = bytes.get(start..start + header_len).ok_or("truncated .npy header")?;
    let header = std::str::from_utf8(header).map_err(|_| "the .npy header is not text")?;
    let field = |name: &str| -> Result<&str, String> {
        let key = format!("'{name}':");
        let at = header.find(&key).ok_or(format!("the .npy header has no {name}"))? + key.len();
        Ok(header[at..].trim_start())
    };
    let descr = field("descr")?;
    let descr = descr.strip_prefix('\'').and_then(|d| d.split('\'').next()).ok_or("bad descr")?;
    if field("fortran_order")?.starts_with("True") {
        return Err("Fortran-order arrays are not supported; save with np.ascontiguousarray".into());
    }
    let shape_text = field("shape")?;
    let shape_text = shape_text.strip_prefix('(').and_then(|s| s.split(')').next()).ok_or("bad shape")?;
    let dims: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| format!("bad dimension {s:?}")))
        .collect::<Result<_, _>>()?;
    let count = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or("shape overflows")?;
    let data = &bytes[start + header_len..];
    let values: Vec<f32> = match descr {
        "<f4" | "|f4" => chunks(data, 4, count)?.map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect(),
        "<f8" => chunks(data, 8, count)?.map(|c| f64::from_le_bytes(c.try_into().expect("8")) as f32).collect(),
        "<f2" => chunks(data, 2, count)?.map(|c| half::f16::from_le_bytes(c.try_into().expect("2")).to_f32()).collect(),
        other => return Err(format!("element type {other:?} is not supported (need <f4, <f8 or <f2)")),
    };
    Tensor::from_vec(values, dims, &Device::Cpu).map_err(|e| e.to_string())
}

fn chunks(data: &[u8], size: usize, count: usize) -> Result<std::slice::ChunksExact<'_, u8>, String> {
    let need = count.checked_mul(size).ok_or("array too large")?;
    if data.len() < need {
        return Err(format!("truncated data: {} bytes for {count} elements of {size} bytes", data.len()));
    }
    Ok(data[..need].chunks_exact(size))
}

fn read_safetensors(path: &Path) -> Result<Tensor, IoError> {
    let bytes = std::fs::read(path).map_err(os_err(path))?;
    parse_safetensors(&bytes).map_err(|m| format_err(path, m))
}

/// The one tensor of a `.safetensors` file's bytes in memory (as [`read_tensor`] reads the file).
pub fn safetensors_from_bytes(bytes: &[u8]) -> Result<Tensor, IoError> {
    parse_safetensors(bytes).map_err(IoError::Malformed)
}

fn parse_safetensors(bytes: &[u8]) -> Result<Tensor, String> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let names = st.names();
    let [name] = names.as_slice() else {
        return Err(format!("expected exactly one tensor, found {}", names.len()));
    };
    let view = st.tensor(name).map_err(|e| e.to_string())?;
    Tensor::from_safetensors_view(&view).map_err(|e| match e {
        SafetensorsError::NotFloat { dtype } => format!("tensor {name:?} is {dtype:?}, expected a float type"),
        SafetensorsError::Tensor(e) => e.to_string(),
    })
}

/// The bytes of a `.npy` file holding `t` as little-endian f32.
pub fn npy_bytes(t: &Tensor) -> Result<Vec<u8>, IoError> {
    let data = t.as_slice_f32().map_err(|e| IoError::Unsupported(e.to_string()))?;
    let mut out = npy_header(t.dims());
    out.reserve_exact(data.len() * 4);
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Ok(out)
}

/// The header of a `.npy` file of little-endian f32 values of shape `dims` (C order), padded
/// so that the data after it starts on a 64-byte boundary.
pub fn npy_header(dims: &[usize]) -> Vec<u8> {
    let shape = match dims {
        [d] => format!("({d},)"),
        dims => format!("({})", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    // Pad so that the data starts on a 64-byte boundary, ending the header with a newline.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out
}

pub use crate::output::write_atomically;

/// diffusers' image post-processing of one decoded image `[3, H, W]` (or `[1, H, W]`):
/// `(x / 2 + 0.5).clamp(0, 1)`, `× 255`, rounded half to even (numpy) — as 8-bit pixels.
pub fn postprocess_image(image: &Tensor) -> Result<(usize, usize, usize, Vec<u8>), IoError> {
    let d = image.dims();
    let &[c, h, w] = d else {
        return Err(IoError::Unsupported(format!("cannot write an image of shape {d:?} as PNG (need [1|3, H, W])")));
    };
    if !(c == 1 || c == 3) {
        return Err(IoError::Unsupported(format!("cannot write an image of shape {d:?} as PNG (need [1|3, H, W])")));
    }
    let data = image.as_slice_f32().map_err(|e| IoError::Unsupported(e.to_string()))?;
    let mut pixels = vec![0u8; c * h * w];
    for ch in 0..c {
        for i in 0..h * w {
            let v = (data[ch * h * w + i] / 2.0 + 0.5).clamp(0.0, 1.0) * 255.0;
            pixels[i * c + ch] = v.round_ties_even() as u8;
        }
    }
    Ok((c, h, w, pixels))
}

/// Whether `a` and `b` name the same file: on Unix the same file-system object when both exist
/// (through symbolic or hard links too), else the same name in the same directory (resolved
/// through links). A path whose directory cannot be resolved matches nothing.
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        use std::os::unix::fs::MetadataExt;
        return x.dev() == y.dev() && x.ino() == y.ino();
    }
    let resolved = |p: &Path| -> Option<PathBuf> {
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        Some(dir.canonicalize().ok()?.join(p.file_name()?))
    };
    matches!((resolved(a), resolved(b)), (Some(x), Some(y)) if x == y)
}

/// Writes every image of a decoded batch `[B, C, H, W]` as PNG: `out.png` for one image,
/// `out_0000.png`, `out_0001.png`, … for several; a video `[B, C, T, H, W]` as one PNG per
/// frame (`out_0000.png`, …, with the batch index first, `out_1_0000.png`, when there are
/// several videos). All or nothing. Returns the paths written.
pub fn write_png_batch(path: &Path, batch: &Tensor) -> Result<Vec<PathBuf>, IoError> {
    let mut staged = Staged::new();
    stage_png_batch(&mut staged, path, batch)?;
    staged.commit()
}

/// [`write_png_batch`] into `staged`: every image encoded and staged next to its target, in
/// place only when `staged` is committed.
pub fn stage_png_batch(staged: &mut Staged, path: &Path, batch: &Tensor) -> Result<(), IoError> {
    let d = batch.dims().to_vec();
    let (images, named): (Tensor, Box<dyn Fn(usize) -> PathBuf>) = match d.len() {
        4 => {
            let count = d[0];
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("image").to_string();
            let single = path.to_path_buf();
            let name = move |b: usize| {
                if count == 1 { single.clone() } else { single.with_file_name(format!("{stem}_{b:04}.png")) }
            };
            (batch.clone(), Box::new(name))
        }
        5 => {
            // [B, C, T, H, W] → [B·T, C, H, W], frames in order.
            let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
            let frames = batch
                .permute(&[0, 2, 1, 3, 4])
                .and_then(|x| x.reshape(vec![b * t, c, h, w]))
                .map_err(|e| IoError::Unsupported(e.to_string()))?;
            let base = path.to_path_buf();
            (frames, Box::new(move |i: usize| video_frame_path(&base, b, i / t, i % t)))
        }
        _ => return Err(IoError::Unsupported(format!("cannot write a tensor of shape {d:?} as images"))),
    };
    let n = images.dims()[0];
    let per_image = images.dims()[1..].to_vec();
    for i in 0..n {
        let one = images
            .narrow(0, i, 1)
            .and_then(|t| t.reshape(per_image.clone()))
            .map_err(|e| IoError::Unsupported(e.to_string()))?;
        staged.add(&named(i), &png_bytes(&one)?)?;
    }
    Ok(())
}

/// Where frame `t` of video `b` of a batch of `videos` goes when `path` names PNG output:
/// `out_0007.png`, or `out_1_0007.png` when there are several videos.
pub fn video_frame_path(path: &Path, videos: usize, b: usize, t: usize) -> PathBuf {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("video");
    path.with_file_name(if videos == 1 { format!("{stem}_{t:04}.png") } else { format!("{stem}_{b}_{t:04}.png") })
}

/// One decoded image `[C, H, W]` in [-1, 1] as an 8-bit PNG file's bytes (diffusers'
/// post-processing, [`postprocess_image`]).
pub fn png_bytes(image: &Tensor) -> Result<Vec<u8>, IoError> {
    let (c, h, w, pixels) = postprocess_image(image)?;
    let mut encoded = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut encoded, w as u32, h as u32);
        encoder.set_color(if c == 3 { png::ColorType::Rgb } else { png::ColorType::Grayscale });
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().map_err(|e| IoError::Unsupported(e.to_string()))?;
        writer.write_image_data(&pixels).map_err(|e| IoError::Unsupported(e.to_string()))?;
    }
    Ok(encoded)
}

/// Reads an image to encode: an 8-bit `.png` ([`read_png`]), else a tensor file in [-1, 1]
/// ([`read_tensor`]).
pub fn read_image(path: impl AsRef<Path>) -> Result<Tensor, IoError> {
    let path = path.as_ref();
    match extension(path).as_str() {
        "png" => read_png(path),
        _ => read_tensor(path),
    }
}

/// Writes decoded pixels (`[B, 3, H, W]` or `[B, 3, T, H, W]` in [-1, 1]) at `path` as the CLI's
/// `--out` does, by extension ([`stage_decoded`]; videos at `fps`): every file or none, each
/// written atomically. Returns the paths written.
pub fn write_decoded(path: impl AsRef<Path>, pixels: &Tensor, fps: u32) -> Result<Vec<PathBuf>, IoError> {
    let mut staged = Staged::new();
    stage_decoded(&mut staged, path.as_ref(), pixels, fps)?;
    staged.commit()
}

/// Writes a tensor as a float32 `.npy` file, atomically.
pub fn write_npy(path: impl AsRef<Path>, tensor: &Tensor) -> Result<(), IoError> {
    crate::output::write_atomically(path.as_ref(), &npy_bytes(tensor)?)
}

/// The file types decoded pixels can be written as ([`stage_decoded`]), by extension.
pub const DECODED_EXTENSIONS: [&str; 4] = ["npy", "png", "mp4", "gif"];

/// Stages decoded pixels (`[B, 3, H, W]` or `[B, 3, T, H, W]` in [-1, 1]) at `path` as its
/// extension says: `.npy` the values, `.png` one image per batch item or frame
/// ([`stage_png_batch`]), `.mp4` or `.gif` one video per batch item at `fps`
/// ([`crate::video::stage_video_batch`]).
pub fn stage_decoded(staged: &mut Staged, path: &Path, pixels: &Tensor, fps: u32) -> Result<(), IoError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    match ext.as_str() {
        "npy" => staged.add(path, &npy_bytes(pixels)?),
        "png" => stage_png_batch(staged, path, pixels),
        "mp4" | "gif" => crate::video::stage_video_batch(staged, path, pixels, fps),
        _ => Err(IoError::Unsupported(format!("{} must end in .npy, .png, .mp4 or .gif", path.display()))),
    }
}

/// The most pixels an input image may have (8192 × 8192): checked from the header, before
/// anything the size of the image is allocated.
pub const MAX_IMAGE_PIXELS: u64 = 1 << 26;

/// Reads an 8-bit RGB(A) or gray PNG as `[1, 3, H, W]` in [-1, 1] (diffusers' `x / 255 · 2 − 1`;
/// no resizing: the size must already suit the model). An image of more than
/// [`MAX_IMAGE_PIXELS`] is an error.
pub fn read_png(path: impl AsRef<Path>) -> Result<Tensor, IoError> {
    let path = path.as_ref();
    let file = std::fs::File::open(path).map_err(os_err(path))?;
    decode_png(std::io::BufReader::new(file)).map_err(|m| format_err(path, m))
}

/// [`read_png`] of a file's bytes in memory.
pub fn png_from_bytes(bytes: &[u8]) -> Result<Tensor, IoError> {
    decode_png(std::io::Cursor::new(bytes)).map_err(IoError::Malformed)
}

fn decode_png(source: impl std::io::BufRead + std::io::Seek) -> Result<Tensor, String> {
    let mut decoder = png::Decoder::new(source);
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(|e| e.to_string())?;
    let (width, height) = (reader.info().width, reader.info().height);
    if u64::from(width) * u64::from(height) > MAX_IMAGE_PIXELS {
        return Err(format!(
            "an image of {width}x{height} pixels is larger than the limit of {MAX_IMAGE_PIXELS} pixels"
        ));
    }
    let size = reader.output_buffer_size().ok_or("image too large")?;
    let mut buf = vec![0u8; size];
    let info = reader.next_frame(&mut buf).map_err(|e| e.to_string())?;
    let (w, h) = (info.width as usize, info.height as usize);
    let channels = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::Grayscale => 1,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Indexed => return Err("indexed PNG after expansion".into()),
    };
    let mut data = vec![0f32; 3 * h * w];
    for i in 0..h * w {
        for ch in 0..3 {
            let src = if channels >= 3 { ch } else { 0 };
            let byte = buf[i * channels + src] as f32;
            data[ch * h * w + i] = byte / 255.0 * 2.0 - 1.0;
        }
    }
    Tensor::from_vec(data, vec![1, 3, h, w], &Device::Cpu).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PNG whose header says `width` × `height` and whose data holds one byte.
    fn png_header_only(width: u32, height: u32) -> Vec<u8> {
        fn crc32(bytes: &[u8]) -> u32 {
            let mut crc = 0xffff_ffffu32;
            for &b in bytes {
                crc ^= u32::from(b);
                for _ in 0..8 {
                    crc = if crc & 1 != 0 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
                }
            }
            !crc
        }
        let mut ihdr = b"IHDR".to_vec();
        ihdr.extend_from_slice(&width.to_be_bytes());
        ihdr.extend_from_slice(&height.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        png.extend_from_slice(&13u32.to_be_bytes());
        png.extend_from_slice(&ihdr);
        png.extend_from_slice(&crc32(&ihdr).to_be_bytes());
        // One short IDAT (a zlib stream of one zero byte): the header is read up to here.
        let mut idat = b"IDAT".to_vec();
        idat.extend_from_slice(&[0x78, 0x9c, 0x63, 0x00, 0x00, 0x00, 0x01, 0x00, 0x01]);
        png.extend_from_slice(&9u32.to_be_bytes());
        png.extend_from_slice(&idat);
        png.extend_from_slice(&crc32(&idat).to_be_bytes());
        png
    }

    #[test]
    fn a_png_whose_header_claims_a_huge_image_is_refused_before_allocation() {
        let dir = std::env::temp_dir().join(format!("vae-io-png-bomb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bomb = dir.join("bomb.png");
        std::fs::write(&bomb, png_header_only(100_000, 100_000)).unwrap();
        assert!(std::fs::metadata(&bomb).unwrap().len() < 100);
        let err = read_png(&bomb).unwrap_err();
        assert!(err.to_string().contains("larger than the limit"), "{err}");
        // At the limit the header is accepted and the missing data is the error.
        std::fs::write(&bomb, png_header_only(8192, 8192)).unwrap();
        let err = read_png(&bomb).unwrap_err();
        assert!(!err.to_string().contains("larger than the limit"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn same_file_sees_through_spellings_and_links() {
        let dir = std::env::temp_dir().join(format!("vae-io-same-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let a = dir.join("a.npy");
        std::fs::write(&a, b"x").unwrap();
        std::fs::write(dir.join("b.npy"), b"x").unwrap();
        assert!(same_file(&a, &a));
        assert!(same_file(&a, &dir.join("sub/../a.npy")), "another spelling of an existing file");
        assert!(!same_file(&a, &dir.join("b.npy")), "same bytes, another file");
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&a, dir.join("link.npy")).unwrap();
            std::fs::hard_link(&a, dir.join("hard.npy")).unwrap();
            assert!(same_file(&dir.join("link.npy"), &a), "a symbolic link");
            assert!(same_file(&a, &dir.join("hard.npy")), "a hard link");
        }
        // Files not written yet: the same name in the same directory, however spelt.
        assert!(same_file(&dir.join("new.npy"), &dir.join("sub/../new.npy")));
        assert!(!same_file(&dir.join("new.npy"), &dir.join("sub/new.npy")));
        assert!(!same_file(Path::new("/nonexistent-dir/x.npy"), Path::new("/nonexistent-dir/x.npy")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_safetensors_input_is_read_as_f32_and_an_integer_one_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, dtype: safetensors::Dtype, bytes: &[u8]| {
            let path = dir.path().join(name);
            let view = safetensors::tensor::TensorView::new(dtype, vec![1, 2], bytes).unwrap();
            std::fs::write(&path, safetensors::serialize([("latent", view)], None).unwrap()).unwrap();
            path
        };
        let bf16: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        let t = read_tensor(write("z.safetensors", safetensors::Dtype::BF16, &bf16)).unwrap();
        assert_eq!((t.dims(), t.to_vec_f32().unwrap()), (&[1, 2][..], vec![1.5, -2.0]));
        let err = read_tensor(write("i.safetensors", safetensors::Dtype::I32, &[0; 8])).unwrap_err();
        assert!(err.to_string().ends_with("tensor \"latent\" is I32, expected a float type"), "{err}");
    }

    #[test]
    fn npy_round_trips() {
        let t = Tensor::from_vec((0..24).map(|i| i as f32 * 0.5).collect(), vec![2, 3, 4], &Device::Cpu).unwrap();
        let back = parse_npy(&npy_bytes(&t).unwrap()).unwrap();
        assert!(back.bit_eq(&t));
        let one = Tensor::from_vec(vec![1.5, 2.5], vec![2], &Device::Cpu).unwrap();
        assert!(parse_npy(&npy_bytes(&one).unwrap()).unwrap().bit_eq(&one));
    }

    #[test]
    fn bad_npy_is_an_error_not_a_panic() {
        assert!(parse_npy(b"hello").is_err());
        let t = Tensor::from_vec(vec![1.0; 8], vec![8], &Device::Cpu).unwrap();
        let bytes = npy_bytes(&t).unwrap();
        assert!(parse_npy(&bytes[..bytes.len() - 4]).unwrap_err().contains("truncated"));
        // A header that claims 1.6e16 elements over a few bytes is refused before any allocation.
        let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 16, 100000, 100000, 100000), }";
        let mut huge = b"\x93NUMPY\x01\x00".to_vec();
        huge.extend_from_slice(&(header.len() as u16 + 1).to_le_bytes());
        huge.extend_from_slice(header.as_bytes());
        huge.extend_from_slice(b"\n");
        huge.extend_from_slice(&[0; 64]);
        assert!(parse_npy(&huge).unwrap_err().contains("truncated data: 64 bytes for 16000000000000000 elements"));
    }

    #[test]
    fn postprocess_matches_diffusers_rounding() {
        let t = Tensor::from_vec(vec![-1.0, 1.0, 0.0, 3.0], vec![1, 2, 2], &Device::Cpu).unwrap();
        let (_, _, _, px) = postprocess_image(&t).unwrap();
        // 0.5 * 255 = 127.5 rounds half to even: 128.
        assert_eq!(px, vec![0, 255, 128, 255]);
    }
}
