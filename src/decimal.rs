//! Decimal text of an unsigned integer without `fmt`: the hot paths write numbers (rate-limit
//! header values, the packed Redis batch) where `write!`'s formatting machinery costs several
//! times the digit loop.

/// The digits of `n`, written into the end of `buf`.
pub fn digits(n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut start = buf.len();
    let mut rest = n;
    loop {
        start -= 1;
        buf[start] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    &buf[start..]
}

#[cfg(test)]
mod tests {
    #[test]
    fn digits_read_as_the_number() {
        for n in [0, 1, 9, 10, 99, 100, 1_763_900_000_123_457, u64::MAX] {
            let mut buf = [0u8; 20];
            assert_eq!(super::digits(n, &mut buf), n.to_string().as_bytes());
        }
    }
}
