//! RESP2, as much as the batcher's own connection (`wire.rs`) needs: the
//! command encoder and a reply parser for bytes read from a socket, which are
//! untrusted (a co-tenant's proxy, a broken server, a bit flip): no input
//! makes it panic, read past its buffer, or reserve room for more replies
//! than the bytes it was given can hold. Depends on `bytes` only, so the
//! fuzz target `resp_reply` compiles this file by path.

use bytes::Bytes;

/// Largest reply accepted: a batch of 256 answers is a few KiB; anything
/// near this is not a reply to our commands.
pub(crate) const MAX_REPLY: usize = 1 << 20;
/// Deepest nesting accepted (our replies are at most an array of scalars).
const MAX_DEPTH: usize = 3;

/// Append `args` as one RESP command (an array of bulk strings).
pub(crate) fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
    header(out, b'*', args.len());
    for arg in args {
        bulk(out, arg);
    }
}

/// `*n\r\n` (`kind` `*`) or `$n\r\n` (`$`).
pub(crate) fn header(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    push_decimal(out, n as u64);
    out.extend_from_slice(b"\r\n");
}

/// One bulk string.
pub(crate) fn bulk(out: &mut Vec<u8>, arg: &[u8]) {
    header(out, b'$', arg.len());
    out.extend_from_slice(arg);
    out.extend_from_slice(b"\r\n");
}

/// `n` in decimal as one bulk string.
pub(crate) fn bulk_decimal(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let at = decimal(&mut digits, n);
    bulk(out, &digits[at..]);
}

/// `n` in decimal digits.
pub(crate) fn push_decimal(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let at = decimal(&mut digits, n);
    out.extend_from_slice(&digits[at..]);
}

fn decimal(digits: &mut [u8; 20], mut n: u64) -> usize {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return at;
        }
    }
}

/// One RESP2 reply.
#[derive(Debug, PartialEq)]
pub(crate) enum Frame {
    /// `+text`
    Simple(String),
    /// `-text`: a Redis error reply (also as an element of an array).
    Error(String),
    /// `:n`
    Integer(i64),
    /// `$n` and n bytes.
    Bulk(Bytes),
    /// `$-1` or `*-1`.
    Null,
    /// `*n` and n replies.
    Array(Vec<Frame>),
}

/// Why bytes are not a reply.
#[derive(Debug, PartialEq)]
pub(crate) struct Malformed(pub(crate) &'static str);

/// One RESP2 reply from the front of `buf` and the bytes it used; `None`
/// while it is incomplete. Every length is checked against the buffer and
/// [`MAX_REPLY`], nesting against a small depth, so no input panics or
/// allocates more than it holds.
pub(crate) fn parse(buf: &[u8]) -> Result<Option<(Frame, usize)>, Malformed> {
    let mut at = 0;
    match value(buf, &mut at, 0)? {
        Some(reply) => Ok(Some((reply, at))),
        None => Ok(None),
    }
}

fn value(buf: &[u8], at: &mut usize, depth: usize) -> Result<Option<Frame>, Malformed> {
    let Some(line) = line(buf, *at)? else {
        return Ok(None);
    };
    let (kind, text) = (buf[*at], &buf[*at + 1..line]);
    let next = line + 2;
    let reply = match kind {
        b'+' => Frame::Simple(utf8(text)?.to_owned()),
        b'-' => Frame::Error(String::from_utf8_lossy(text).into_owned()),
        b':' => Frame::Integer(integer(text)?),
        b'$' => {
            let len = integer(text)?;
            if len == -1 {
                *at = next;
                return Ok(Some(Frame::Null));
            }
            let len = usize::try_from(len).map_err(|_| Malformed("negative length"))?;
            if len > MAX_REPLY {
                return Err(Malformed("bulk string too long"));
            }
            let end = next + len;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(Malformed("bulk string not ended by CRLF"));
            }
            *at = end + 2;
            let data = &buf[next..end];
            return Ok(Some(Frame::Bulk(Bytes::copy_from_slice(data))));
        }
        b'*' => {
            let len = integer(text)?;
            if len == -1 {
                *at = next;
                return Ok(Some(Frame::Null));
            }
            let len = usize::try_from(len).map_err(|_| Malformed("negative length"))?;
            if depth >= MAX_DEPTH {
                return Err(Malformed("arrays nested too deep"));
            }
            // Each element takes at least 3 bytes: never reserve for more
            // elements than the rest of the buffer can hold.
            if len > (buf.len() - next) / 3 + 1 {
                if len > MAX_REPLY / 3 {
                    return Err(Malformed("array too long"));
                }
                return Ok(None);
            }
            let mut items = Vec::with_capacity(len);
            let mut pos = next;
            for _ in 0..len {
                match value(buf, &mut pos, depth + 1)? {
                    Some(item) => items.push(item),
                    None => return Ok(None),
                }
            }
            *at = pos;
            return Ok(Some(Frame::Array(items)));
        }
        _ => return Err(Malformed("unknown reply type")),
    };
    *at = next;
    Ok(Some(reply))
}

/// The index of the CRLF ending the line that starts at `at`; `None` while
/// it has not arrived.
fn line(buf: &[u8], at: usize) -> Result<Option<usize>, Malformed> {
    let rest = buf.get(at..).unwrap_or_default();
    if rest.is_empty() {
        return Ok(None);
    }
    // A reply line of ours is short: a line that long is not one.
    let window = &rest[..rest.len().min(64 * 1024)];
    match window.iter().position(|&b| b == b'\r') {
        Some(i) if i + 1 < rest.len() => {
            if rest[i + 1] != b'\n' {
                return Err(Malformed("CR without LF"));
            }
            if i == 0 {
                return Err(Malformed("empty line"));
            }
            Ok(Some(at + i))
        }
        Some(_) => Ok(None),
        None if window.len() < rest.len() => Err(Malformed("line too long")),
        None => Ok(None),
    }
}

fn utf8(text: &[u8]) -> Result<&str, Malformed> {
    std::str::from_utf8(text).map_err(|_| Malformed("simple string is not UTF-8"))
}

fn integer(text: &[u8]) -> Result<i64, Malformed> {
    utf8(text)?.parse().map_err(|_| Malformed("not an integer"))
}

#[cfg(test)]
mod tests;
