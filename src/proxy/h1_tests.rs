use super::*;

/// Parses `head`, with its kept fields moved into the response's map, as hyper's server sees them.
fn parse(head: &[u8], head_only: bool) -> Result<Option<(Response<()>, Framing, bool)>, Error> {
    let mut buf = BytesMut::from(head);
    Ok(parse_head(&mut buf, head_only)?.map(|mut head| {
        head.fields.merge_into(head.response.headers_mut());
        (head.response, head.framing, head.keep_alive)
    }))
}

#[test]
fn a_partial_head_waits_for_more() {
    assert!(matches!(
        parse(b"HTTP/1.1 200 OK\r\ncontent-le", false),
        Ok(None)
    ));
}

#[test]
fn content_length_frames_the_body_and_keeps_the_connection() {
    let (response, framing, keep_alive) = parse(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\nok",
        false,
    )
    .unwrap()
    .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-a"], "b");
    assert!(matches!(framing, Framing::Length(2)));
    assert!(keep_alive);
}

#[test]
fn equal_repeated_lengths_are_one_and_different_ones_are_refused() {
    let ok = parse(
        b"HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\ncontent-length: 3\r\n\r\n",
        false,
    );
    assert!(matches!(ok, Ok(Some((_, Framing::Length(3), true)))));
    let bad = parse(
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
        false,
    );
    assert!(matches!(bad, Err(Error::Malformed(_))));
    let sign = parse(b"HTTP/1.1 200 OK\r\ncontent-length: +3\r\n\r\n", false);
    assert!(matches!(sign, Err(Error::Malformed(_))));
}

#[test]
fn transfer_encoding_with_content_length_is_refused() {
    let both = parse(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n",
        false,
    );
    assert!(matches!(both, Err(Error::Malformed(_))));
}

#[test]
fn the_last_transfer_coding_decides() {
    let chunked = parse(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        false,
    );
    assert!(matches!(
        chunked,
        Ok(Some((_, Framing::Chunked(Chunk::Size), true)))
    ));
    let close = parse(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n",
        false,
    );
    assert!(matches!(close, Ok(Some((_, Framing::UntilClose, false)))));
}

#[test]
fn head_204_and_304_have_no_body_whatever_they_declare() {
    assert!(matches!(
        parse(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n", true),
        Ok(Some((_, Framing::Done, true)))
    ));
    assert!(matches!(
        parse(b"HTTP/1.1 204 No Content\r\n\r\n", false),
        Ok(Some((_, Framing::Done, true)))
    ));
    assert!(matches!(
        parse(
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n",
            false
        ),
        Ok(Some((_, Framing::Done, true)))
    ));
}

#[test]
fn connection_close_and_http_1_0_end_reuse() {
    assert!(matches!(
        parse(
            b"HTTP/1.1 200 OK\r\nconnection: Close\r\ncontent-length: 0\r\n\r\n",
            false
        ),
        Ok(Some((_, _, false)))
    ));
    assert!(matches!(
        parse(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", false),
        Ok(Some((_, _, false)))
    ));
    assert!(matches!(
        parse(
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n",
            false
        ),
        Ok(Some((_, _, true)))
    ));
    // No length at all: the body runs to the close.
    assert!(matches!(
        parse(b"HTTP/1.1 200 OK\r\n\r\n", false),
        Ok(Some((_, Framing::UntilClose, false)))
    ));
}

#[test]
fn malformed_heads_are_errors() {
    assert!(parse(b"HTTP/1.1 2000 OK\r\n\r\n", false).is_err());
    assert!(parse(b"SMTP ready\r\n\r\n", false).is_err());
    assert!(parse(b"HTTP/1.1 200 OK\r\nbad name: x\r\n\r\n", false).is_err());
}

#[test]
fn chunk_sizes_are_hexadecimal_with_extensions_ignored() {
    assert_eq!(chunk_size(b"1a\r"), Some(26));
    assert_eq!(chunk_size(b"1A;name=value\r"), Some(26));
    assert_eq!(chunk_size(b"0\r"), Some(0));
    assert_eq!(chunk_size(b"\r"), None);
    assert_eq!(chunk_size(b"zz\r"), None);
    assert_eq!(chunk_size(b"1000000000000000\r"), None);
}

#[test]
fn the_request_head_is_origin_form_with_its_fields() {
    let req = http::Request::builder()
        .method(Method::POST)
        .uri("/a/b?c=d")
        .header("host", "example")
        .header("x-two", "1")
        .body(())
        .unwrap();
    let (parts, ()) = req.into_parts();
    let mut buf = Vec::new();
    encode_head(&mut buf, &parts);
    assert_eq!(
        buf,
        b"POST /a/b?c=d HTTP/1.1\r\nhost: example\r\nx-two: 1\r\ncontent-length: 0\r\n\r\n"
    );
    let get = http::Request::builder().uri("/").body(()).unwrap();
    let (parts, ()) = get.into_parts();
    encode_head(&mut buf, &parts);
    assert_eq!(buf, b"GET / HTTP/1.1\r\n\r\n");
}

#[test]
fn only_bodiless_requests_without_upgrade_suit() {
    let plain = http::Request::get("/").body(()).unwrap().into_parts().0;
    assert!(suits(&plain, true));
    assert!(!suits(&plain, false));
    let upgrade = http::Request::get("/")
        .header("upgrade", "websocket")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    assert!(!suits(&upgrade, true));
    let connect = http::Request::connect("example:443")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    assert!(!suits(&connect, true));
}

#[test]
fn hop_by_hop_fields_are_never_kept() {
    let (response, framing, keep_alive) = parse(
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nX-Hop: secret\r\n\
          Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTE: trailers\r\n\
          Trailer: x-sum\r\nUpgrade: h2c\r\nTransfer-Encoding: chunked\r\nX-End: kept\r\n\r\n",
        false,
    )
    .expect("parsed")
    .expect("complete");
    let names: Vec<&str> = response.headers().keys().map(|n| n.as_str()).collect();
    assert_eq!(names, ["x-end"]);
    // Still read for framing and reuse.
    assert!(matches!(framing, Framing::Chunked(_)));
    assert!(keep_alive);
}

#[test]
fn field_names_are_classified_in_any_case_and_only_when_whole() {
    for (name, kind) in [
        (&b"Content-Length"[..], Field::ContentLength),
        (b"CONTENT-LENGTH", Field::ContentLength),
        (b"transfer-Encoding", Field::TransferEncoding),
        (b"Connection", Field::Connection),
        (b"KEEP-ALIVE", Field::OtherHop),
        (b"Te", Field::OtherHop),
        (b"Trailer", Field::OtherHop),
        (b"upgradE", Field::OtherHop),
        (b"Proxy-Connection", Field::OtherHop),
        // The same lengths, other names.
        (b"Content_Length", Field::EndToEnd),
        (b"Contentxlength", Field::EndToEnd),
        (b"X-Upgrd", Field::EndToEnd),
        (b"Keep-Alivf", Field::EndToEnd),
        (b"tf", Field::EndToEnd),
        (b"Content-Type", Field::EndToEnd),
    ] {
        assert_eq!(classify(name), kind, "{}", String::from_utf8_lossy(name));
    }
}
