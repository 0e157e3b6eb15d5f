//! Input checks every family shares: finite values, and whether a request can fit in memory.

use vae_tensor::Tensor;

use crate::{ModelError, Result};

/// An error naming how many values of `what` are NaN or infinite and where the first is: such
/// an input would decode to garbage without a word.
pub(crate) fn check_finite(t: &Tensor, what: &str) -> Result<()> {
    let values = t.as_slice_f32()?;
    let Some(first) = values.iter().position(|v| !v.is_finite()) else { return Ok(()) };
    let count = values.iter().filter(|v| !v.is_finite()).count();
    let strides = t.shape().strides();
    let index: Vec<usize> = strides.iter().zip(t.dims()).map(|(s, n)| (first / s) % n).collect();
    Err(ModelError::InvalidInput(format!(
        "{what} has {count} non-finite value(s); the first is {} at index {index:?}",
        values[first]
    )))
}

/// Caps the memory a request may plan for on this machine (bytes, or with a `K`, `M`, `G` or
/// `T` suffix, powers of 1024): the lower of it and the memory the system has available.
pub const ENV_MEMORY_LIMIT: &str = "VAE_MEMORY_LIMIT";

/// Bytes a request may use here: the system's available memory (Linux `MemAvailable`) or
/// [`ENV_MEMORY_LIMIT`], whichever is lower; `None` when neither is known.
pub(crate) fn available_memory() -> Option<u64> {
    let system = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
    });
    let limit = std::env::var(ENV_MEMORY_LIMIT).ok().and_then(|v| parse_bytes(&v));
    match (system, limit) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `123`, `64K`, `8G`, `1.5T` (powers of 1024).
fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let (number, unit) = match text.char_indices().last()? {
        (i, c) if c.is_ascii_alphabetic() => (&text[..i], c.to_ascii_uppercase()),
        _ => (text, 'B'),
    };
    let scale: f64 = match unit {
        'B' => 1.0,
        'K' => 1024.0,
        'M' => 1024.0 * 1024.0,
        'G' => 1024.0 * 1024.0 * 1024.0,
        'T' => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    let value: f64 = number.trim().parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some((value * scale) as u64)
}

fn human(bytes: u64) -> String {
    let units = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    match units.iter().find(|(_, size)| bytes >= *size) {
        Some((unit, size)) => format!("{:.1} {unit}", bytes as f64 / *size as f64),
        None => format!("{bytes} B"),
    }
}

/// An error before any work when a request cannot fit: `output` bytes of result on the rank
/// that assembles it plus `activation` bytes of the largest single feature map one rank holds
/// are a floor of what it needs (the real peak is higher), so a floor above the available
/// memory means the request would fail for certain. `advice` says what would shrink the
/// feature map (tiles, a shard); when the output alone does not fit, only a smaller request
/// helps, and the error says so.
pub(crate) fn ensure_fits(output: u64, activation: u64, advice: &str) -> Result<()> {
    let Some(available) = available_memory() else { return Ok(()) };
    let needed = output.saturating_add(activation);
    if needed <= available {
        return Ok(());
    }
    let advice = if output > available {
        "the whole output is assembled on one rank: ask for fewer frames or fewer pixels"
    } else {
        advice
    };
    Err(ModelError::InvalidInput(format!(
        "this request needs at least {} ({} of output, {} for its largest feature map), and this machine has {} \
         available; {advice}",
        human(needed),
        human(output),
        human(activation),
        human(available)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("123"), Some(123));
        assert_eq!(parse_bytes("64k"), Some(64 << 10));
        assert_eq!(parse_bytes("8G"), Some(8 << 30));
        assert_eq!(parse_bytes(" 1.5T "), Some(3 << 39));
        for bad in ["", "G", "-1G", "12X", "one"] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }
}
