use super::*;

fn parse(bytes: &[u8]) -> (Option<Request<ClientBody>>, BytesMut) {
    let mut buf = BytesMut::from(bytes);
    let request = parse_request(&mut buf, 8 * 1024);
    (request, buf)
}

#[test]
fn a_plain_get_is_taken_and_the_rest_of_the_buffer_kept() {
    let (request, rest) =
        parse(b"GET /a/b?c=d HTTP/1.1\r\nHost: x\r\nX-Two: 1\r\nx-two: 2\r\n\r\nGET /next");
    let request = request.expect("taken");
    assert_eq!(request.method(), Method::GET);
    assert_eq!(request.uri().path(), "/a/b");
    assert_eq!(request.uri().query(), Some("c=d"));
    assert_eq!(request.version(), Version::HTTP_11);
    assert_eq!(request.headers()["host"], "x");
    let twos: Vec<_> = request.headers().get_all("x-two").iter().collect();
    assert_eq!(twos, ["1", "2"]);
    assert_eq!(&rest[..], b"GET /next");
}

#[test]
fn requests_asking_for_more_are_left_whole_for_hyper() {
    let cases: [&[u8]; 12] = [
        b"POST / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.0\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nTE: trailers\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        // Incomplete, malformed, or refused by `http`.
        b"GET / HTTP/1.1\r\nHost: x\r\n",
        b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
        b"GET /\x7f HTTP/1.1\r\nHost: x\r\n\r\n",
    ];
    for case in cases {
        let (request, rest) = parse(case);
        assert!(request.is_none(), "{}", String::from_utf8_lossy(case));
        assert_eq!(&rest[..], case, "{}", String::from_utf8_lossy(case));
    }
}

#[test]
fn a_head_over_the_size_limit_is_left_for_hyper_s_431() {
    let head = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut buf = BytesMut::from(&head[..]);
    assert!(parse_request(&mut buf, head.len() - 1).is_none());
    assert_eq!(&buf[..], head);
    assert!(parse_request(&mut buf, head.len()).is_some());
}

#[test]
fn keep_alive_is_the_one_connection_option_taken() {
    let (request, _) = parse(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Keep-Alive\r\n\r\n");
    assert!(request.is_some());
}

fn head(
    status: StatusCode,
    fields: &[(&str, &str)],
    body: ResponseBody,
    closing: bool,
) -> (String, Framing, bool) {
    let mut headers = HeaderMap::new();
    for (name, value) in fields {
        headers.append(
            HeaderName::from_bytes(name.as_bytes()).expect("name"),
            HeaderValue::from_str(value).expect("value"),
        );
    }
    let mut out = BytesMut::new();
    let (framing, reusable) = encode_head(&mut out, &status, &headers, &body, closing);
    (
        String::from_utf8(out.to_vec()).expect("text"),
        framing,
        reusable,
    )
}

#[test]
fn a_known_size_is_sent_as_content_length_and_a_date_is_added() {
    let (text, framing, reusable) = head(
        StatusCode::TOO_MANY_REQUESTS,
        &[("retry-after", "1")],
        ResponseBody::full("slow down"),
        false,
    );
    assert!(
        text.starts_with("HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\ndate: "),
        "{text}"
    );
    assert!(text.ends_with("GMT\r\ncontent-length: 9\r\n\r\n"), "{text}");
    assert_eq!(framing, Framing::Length(9));
    assert!(reusable);
}

#[test]
fn a_given_length_and_date_are_kept_and_written_once() {
    let (text, framing, _) = head(
        StatusCode::OK,
        &[
            ("content-length", "5"),
            ("content-length", "7"),
            ("transfer-encoding", "chunked"),
            ("date", "Tue, 24 Nov 2026 00:00:00 GMT"),
        ],
        ResponseBody::empty(),
        false,
    );
    assert_eq!(
        text,
        "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ndate: Tue, 24 Nov 2026 00:00:00 GMT\r\n\r\n"
    );
    assert_eq!(framing, Framing::Length(5));
}

#[test]
fn bodiless_statuses_have_no_framing_added() {
    for status in [StatusCode::NO_CONTENT, StatusCode::NOT_MODIFIED] {
        let (text, framing, _) = head(status, &[("date", "d")], ResponseBody::full("x"), false);
        assert!(!text.contains("content-length"), "{text}");
        assert!(!text.contains("transfer-encoding"), "{text}");
        assert_eq!(framing, Framing::None);
    }
}

#[test]
fn closing_and_close_asked_make_the_connection_end() {
    let (text, _, reusable) = head(
        StatusCode::OK,
        &[("connection", "keep-alive"), ("date", "d")],
        ResponseBody::empty(),
        true,
    );
    assert!(!reusable);
    assert!(text.contains("connection: close\r\n"), "{text}");
    assert!(!text.contains("keep-alive"), "{text}");
    let (_, _, reusable) = head(
        StatusCode::OK,
        &[("connection", "x-hop, Close")],
        ResponseBody::empty(),
        false,
    );
    assert!(!reusable);
}

#[test]
fn numbers_are_written_as_the_standard_formats_write_them() {
    for n in [
        0u64,
        1,
        9,
        10,
        255,
        4096,
        65_535,
        u64::from(u32::MAX),
        u64::MAX,
    ] {
        let mut out = BytesMut::new();
        put_decimal(&mut out, n);
        assert_eq!(&out[..], n.to_string().as_bytes());
        if let Ok(n) = usize::try_from(n) {
            let mut out = BytesMut::new();
            put_hex(&mut out, n);
            assert_eq!(&out[..], format!("{n:x}").as_bytes());
        }
    }
}

/// The `date` field is made once a second: the same bytes within the second, the wall clock's
/// next second once the last clock reading (`crate::now`) is past the second's end.
#[test]
fn the_date_field_is_remade_when_its_second_is_over() {
    let date = || {
        let mut out = BytesMut::new();
        put_date(&mut out);
        String::from_utf8(out.to_vec()).expect("ascii")
    };
    crate::now::read();
    let first = date();
    let wall = |line: &str| {
        let text = line.trim_start_matches("date: ").trim_end();
        httpdate::parse_http_date(text).expect("an IMF-fixdate")
    };
    let before = wall(&first);
    // Not read since: the cached line stands whatever the wall clock says.
    assert_eq!(date(), first);
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(date(), first, "the reading was not renewed");
    crate::now::read();
    let second = date();
    let after = wall(&second);
    assert!(after > before, "{first:?} then {second:?}");
    let now = SystemTime::now();
    assert!(after <= now && now.duration_since(after).expect("after") < Duration::from_secs(2));
}
