//! A minimal little-endian codec for the small control messages ranks exchange (status,
//! tile shapes). Decoding failures are protocol errors, never panics.

use crate::RuntimeError;

#[derive(Debug, Default)]
pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }

    pub(crate) fn str(&mut self, s: &str) -> &mut Self {
        self.usize(s.len());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
}

pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Self { bytes, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], RuntimeError> {
        if self.bytes.len() < n {
            return Err(RuntimeError::Protocol(format!("truncated {}", self.what)));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, RuntimeError> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn u64(&mut self) -> Result<u64, RuntimeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    pub(crate) fn usize(&mut self) -> Result<usize, RuntimeError> {
        usize::try_from(self.u64()?).map_err(|_| RuntimeError::Protocol(format!("oversized count in {}", self.what)))
    }

    pub(crate) fn str(&mut self) -> Result<String, RuntimeError> {
        let len = self.usize()?;
        Ok(String::from_utf8_lossy(self.take(len)?).into_owned())
    }

    pub(crate) fn rest(self) -> &'a [u8] {
        self.bytes
    }
}
