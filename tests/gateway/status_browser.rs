//! The status page in a real browser (issue 42): headless Chromium loads it from a running
//! gateway; the routes and live counts it shows are checked against the config and the traffic
//! sent, an override is set (a validation error shown) and deleted through the page, the lookup
//! reads a key's state, and a form posted from another origin is refused. Screenshots go to
//! `$TURNSTILE_STATUS_SCREENSHOTS` when set (docs/status-*.png are made so), else to a temp dir.

use std::path::PathBuf;

use crate::support::chromium::Chromium;
use crate::support::{Client, TestGateway};

/// The text of the element `selector` on the page.
fn text_of(selector: &str) -> String {
    format!("document.querySelector({selector:?})?.textContent")
}

fn policy_cell(route: &str, policy: &str, class: &str) -> String {
    text_of(&format!(
        "tr.policy[data-route=\"{route}\"][data-policy=\"{policy}\"] .{class}"
    ))
}

/// Sets a form field as a user would (and fires its `change`).
fn set(id: &str, value: &str) -> String {
    format!(
        "(() => {{ const e = document.getElementById({id:?}); e.value = {value:?}; \
         e.dispatchEvent(new Event('change')); return e.value === {value:?}; }})()"
    )
}

#[tokio::test]
async fn the_status_page_in_chromium_shows_live_counts_and_writes_overrides() {
    let gw = TestGateway::start(super::status::CONFIG).await;
    let c = Client::new();
    let mut sent = Vec::new();
    for _ in 0..7 {
        sent.push(c.get(&gw.url("/hello")).await.status);
    }
    assert_eq!(sent, [200, 200, 200, 200, 200, 429, 429]);
    for _ in 0..2 {
        assert_eq!(c.get(&gw.url("/api/users/7")).await.status, 200);
    }
    let shots = match std::env::var_os("TURNSTILE_STATUS_SCREENSHOTS") {
        Some(dir) => (PathBuf::from(dir), None),
        None => {
            let dir = tempfile::tempdir().expect("tempdir");
            (dir.path().to_path_buf(), Some(dir))
        }
    };

    let browser = Chromium::start(1280, 1000);
    let mut page = browser.page().await;
    page.navigate(&gw.admin_url("/")).await;
    let order = page
        .wait_for(
            "document.querySelectorAll('#routes tr.route').length === 2 && \
             [...document.querySelectorAll('#routes tr.route')].map(r => r.dataset.route).join(',')",
            "the routes",
        )
        .await;
    assert_eq!(order, "hello,users", "routes in match order");
    let policies = page
        .eval("[...document.querySelectorAll('#routes tr.policy')].map(r => r.dataset.route + '/' + r.dataset.policy + ' ' + r.cells[2].textContent + ' ' + r.cells[3].textContent + ' ' + r.cells[4].textContent)")
        .await;
    assert_eq!(
        policies,
        serde_json::json!([
            "hello/per_ip sliding_window · 5 per 3600s client_ip enforce",
            "users/per_user token_bucket · 1/h, burst 3 path:user_id enforce",
            "users/per_tenant quota · 100 per day (UTC) header:x-tenant + method shadow",
        ])
    );
    assert_eq!(
        page.eval(&policy_cell("hello", "per_ip", "total-allowed"))
            .await,
        "5"
    );
    assert_eq!(
        page.eval(&policy_cell("hello", "per_ip", "total-limited"))
            .await,
        "2"
    );
    assert_eq!(
        page.eval(&policy_cell("users", "per_user", "total-allowed"))
            .await,
        "2"
    );
    let store = page.wait_for(&text_of("#store"), "the instance").await;
    assert_eq!(store, "memory · ready");

    // Live: three more refused requests show in the next refresh, as a total and as a rate.
    for _ in 0..3 {
        assert_eq!(c.get(&gw.url("/hello")).await.status, 429);
    }
    let limited = policy_cell("hello", "per_ip", "total-limited");
    let rate = policy_cell("hello", "per_ip", "rate-limited");
    page.wait_for(
        &format!("{limited} === '5' && parseFloat({rate}) > 0"),
        "5 limited, at a rate above 0",
    )
    .await;
    page.wait_for(
        "document.querySelectorAll('#top tbody tr').length === 1 && \
         document.querySelector('#top tbody td.num').textContent === '5'",
        "the limited key in the top list, 5 times",
    )
    .await;
    let top = page.eval(&text_of("#top tbody tr")).await;
    let top = top.as_str().expect("top row");
    assert!(
        top.starts_with("helloper_ipsha256:"),
        "a digest, not the address: {top}"
    );
    assert!(top.ends_with('5'), "{top}");
    let size = page.screenshot(&shots.0.join("status-overview.png")).await;
    assert!(size > 10_000, "a screenshot of {size} bytes");

    // An override through the page: a validation error first, shown as the API words it.
    for (id, value) in [
        ("ov-route", "hello"),
        ("ov-policy", "per_ip"),
        ("ov-key", "127.0.0.1"),
        ("ov-limit", "0"),
    ] {
        assert_eq!(page.eval(&set(id, value)).await, true, "{id}");
    }
    page.eval("document.getElementById('ov-set').click()").await;
    let error = page
        .wait_for(
            "!document.getElementById('override-error').hidden && document.getElementById('override-error').textContent",
            "the validation error",
        )
        .await;
    assert_eq!(error, "400: limit: must be at least 1");
    assert_eq!(page.eval(&set("ov-limit", "50")).await, true);
    page.eval("document.getElementById('ov-set').click()").await;
    page.wait_for(
        "document.querySelector('tr.override[data-key=\"127.0.0.1\"]')",
        "the override in the list",
    )
    .await;
    let listed = c.get(&gw.admin_url("/overrides")).await.json();
    assert_eq!(listed["overrides"][0]["limit"], 50);
    assert_eq!(listed["overrides"][0]["source"], "api");
    // It applies: the exhausted key's 5 admitted requests and this one leave 44 of 50.
    assert_eq!(
        c.get(&gw.url("/hello"))
            .await
            .header_u64("x-ratelimit-remaining"),
        44
    );

    // The lookup: user 7 spent 2 of 3.
    assert_eq!(page.eval(&set("peek-route", "users")).await, true);
    page.eval("document.querySelector('input.peek-key[data-policy=per_user]').value = '7'")
        .await;
    page.eval("document.getElementById('peek-go').click()")
        .await;
    let remaining = page
        .wait_for(
            &text_of("tr.peeked[data-policy=per_user] .remaining"),
            "the lookup",
        )
        .await;
    assert_eq!(remaining, "1");
    assert_eq!(
        page.eval(&text_of("tr.peeked[data-policy=per_user] .next"))
            .await,
        "allowed"
    );
    page.eval("window.scrollTo(0, document.body.scrollHeight)")
        .await;
    let size = page
        .screenshot(&shots.0.join("status-overrides-lookup.png"))
        .await;
    assert!(size > 10_000);

    // Delete it through the page.
    page.eval(
        "document.querySelector('tr.override[data-key=\"127.0.0.1\"] button.delete').click()",
    )
    .await;
    page.wait_for(
        "!document.querySelector('tr.override') && document.getElementById('override-message').textContent",
        "the override gone",
    )
    .await;
    let listed = c.get(&gw.admin_url("/overrides")).await.json();
    assert_eq!(listed["overrides"], serde_json::json!([]));
    assert_eq!(
        c.get(&gw.url("/hello")).await.status,
        429,
        "the policy's own limit again"
    );
}

/// A page on another origin (the public listener) posts a form to the admin API, as a CSRF
/// attack would: Chromium sends it, the admin listener refuses it, nothing is set.
#[tokio::test]
async fn a_form_posted_from_another_origin_in_chromium_is_refused() {
    let gw = TestGateway::start(super::status::CONFIG).await;
    let attack = format!(
        r#"
routes:
  - name: evil
    match: {{ path: /evil }}
    respond:
      content_type: text/html
      body: |
        <form method="post" action="http://{admin}/overrides/hello/per_ip/127.0.0.1">
        <input name="limit" value="1000000"></form>
        <script>document.forms[0].submit()</script>
{rest}"#,
        admin = gw.admin,
        rest = super::status::CONFIG
            .trim_start()
            .trim_start_matches("routes:\n"),
    );
    gw.reload_with(&attack).await.expect("reload");
    let browser = Chromium::start(1000, 700);
    let mut page = browser.page().await;
    page.call(
        "Page.navigate",
        serde_json::json!({ "url": gw.url("/evil") }),
    )
    .await;
    let landed = page
        .wait_for(
            &format!(
                "location.href.startsWith('http://{}') && document.readyState === 'complete' && document.body.innerText",
                gw.admin
            ),
            "the form's answer",
        )
        .await;
    let landed = landed.as_str().expect("text");
    assert!(landed.contains("cross_site"), "{landed}");
    let listed = Client::new().get(&gw.admin_url("/overrides")).await.json();
    assert_eq!(
        listed["overrides"],
        serde_json::json!([]),
        "nothing was set"
    );
}
