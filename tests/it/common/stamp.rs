//! A lease token's issue time, as `Token::generate` writes it (its last 6
//! bytes, milliseconds since the Unix epoch, big endian) and as Redis
//! stores it (32 hex digits): the one place the tests know that layout.

use tower_redis_lock::backend::contract::Token;

/// Milliseconds since the Unix epoch, now.
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A fresh token issued at `ms`, as Redis stores it.
pub fn issued_at(ms: u64) -> String {
    let mut bytes = *Token::generate().as_bytes();
    bytes[10..].copy_from_slice(&ms.to_be_bytes()[2..]);
    String::from_utf8(Token::from_bytes(bytes).to_hex().to_vec()).unwrap()
}

/// The issue time a token carries, as Redis stores it.
pub fn issued_ms(hex: &str) -> u64 {
    u64::from_str_radix(&hex[20..], 16).unwrap()
}
