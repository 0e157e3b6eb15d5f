//! The little-endian codec of every small message ranks exchange: the socket handshake and
//! address table here, the runtime's status, tile and shape messages above. Integers are
//! 8-byte little-endian words (a `usize` travels as a `u64`), strings a length word then UTF-8
//! bytes. Decoding never panics and never trusts a length: a message that ends early, a count
//! that does not fit, or text that is not UTF-8 is a [`WireError`] naming the message.

/// Builds a message.
#[derive(Debug, Default, Clone)]
pub struct Writer(Vec<u8>);

impl Writer {
    /// An empty message.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    /// Appends a `u64`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a `usize` (as a `u64`).
    pub fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }

    /// Appends a string: its length, then its bytes.
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.usize(s.len());
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    /// Appends raw bytes (no length: the reader takes them with [`Reader::rest`]).
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }

    /// The message so far.
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }

    /// The message.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

/// A message that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// It ended before the field being read.
    #[error("truncated {0}")]
    Truncated(&'static str),
    /// A count or length does not fit this machine's `usize`.
    #[error("oversized count in {0}")]
    Oversized(&'static str),
    /// A string is not UTF-8.
    #[error("{0}: text is not UTF-8")]
    NotUtf8(&'static str),
}

/// Reads a message field by field.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`, a message named `what` in errors ("tile summary").
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Self { bytes, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.bytes.len() < n {
            return Err(WireError::Truncated(self.what));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    /// A `u64`.
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    /// A `usize` (sent as a `u64`).
    pub fn usize(&mut self) -> Result<usize, WireError> {
        usize::try_from(self.u64()?).map_err(|_| WireError::Oversized(self.what))
    }

    /// A string.
    pub fn str(&mut self) -> Result<String, WireError> {
        let len = self.usize()?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::NotUtf8(self.what))
    }

    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        self.take(n)
    }

    /// Everything not read yet.
    pub fn rest(self) -> &'a [u8] {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_in_order() {
        let mut w = Writer::new();
        w.u8(7).u64(u64::MAX).usize(42).str("héllo").bytes(&[1, 2, 3]);
        let bytes = w.into_bytes();
        let mut r = Reader::new(&bytes, "test message");
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.u64(), Ok(u64::MAX));
        assert_eq!(r.usize(), Ok(42));
        assert_eq!(r.str().as_deref(), Ok("héllo"));
        assert_eq!(r.rest(), &[1, 2, 3]);
    }

    #[test]
    fn short_and_lying_messages_are_errors() {
        let mut w = Writer::new();
        w.u64(1 << 40);
        let bytes = w.into_bytes();
        // A string whose length word claims a terabyte.
        assert_eq!(Reader::new(&bytes, "hello").str(), Err(WireError::Truncated("hello")));
        assert_eq!(Reader::new(&bytes[..5], "hello").u64(), Err(WireError::Truncated("hello")));
        let mut w = Writer::new();
        w.usize(2).bytes(&[0xff, 0xfe]);
        assert_eq!(Reader::new(w.as_slice(), "hello").str(), Err(WireError::NotUtf8("hello")));
    }
}
