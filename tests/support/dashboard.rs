//! The PromQL of `dashboards/turnstile.json` and `dashboards/alerts.yml`, read from the files
//! themselves so the tests run exactly what Grafana and Prometheus will, and a reader of instant
//! query results.

use serde_json::Value;

use super::prometheus::Prometheus;
use super::tools::repo_path;

/// Values for the Grafana variables the dashboard's expressions use. The rate interval spans the
/// whole test, so every rate has samples from before and after the traffic.
pub const GRAFANA_VARIABLES: &[(&str, &str)] = &[
    ("$__rate_interval", "1m"),
    ("$__range", "5m"),
    ("$route", ".*"),
];

/// Every PromQL expression of the dashboard, with its panel's title.
pub fn dashboard_queries() -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(repo_path("dashboards/turnstile.json")).expect("read dashboard");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut out = Vec::new();
    collect_panels(&dashboard["panels"], &mut out);
    out
}

fn collect_panels(panels: &Value, out: &mut Vec<(String, String)>) {
    for panel in panels.as_array().into_iter().flatten() {
        let title = panel["title"].as_str().unwrap_or("?").to_string();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .expect("every target has a PromQL expr");
            out.push((
                format!("{title} [{}]", target["refId"].as_str().unwrap_or("?")),
                expr.to_string(),
            ));
        }
        // Panels folded inside a row.
        collect_panels(&panel["panels"], out);
    }
}

pub fn substitute(expr: &str) -> String {
    let mut expr = expr.to_string();
    for (name, value) in GRAFANA_VARIABLES {
        expr = expr.replace(name, value);
    }
    assert!(
        !expr.contains('$'),
        "an unknown Grafana variable is left in `{expr}`"
    );
    expr
}

/// Every alert of the rules file: (name, expr).
pub fn alert_rules() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo_path("dashboards/alerts.yml")).expect("read alerts");
    let rules: Value = serde_norway::from_str(&text).expect("alerts.yml is YAML");
    let mut out = Vec::new();
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let name = rule["alert"]
                .as_str()
                .or(rule["record"].as_str())
                .expect("alert or record");
            out.push((
                name.to_string(),
                rule["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    out
}

/// The expression of the dashboard target `refId` in the panel titled `title`, variables
/// substituted.
pub fn panel_query(title: &str, ref_id: &str) -> String {
    let label = format!("{title} [{ref_id}]");
    let (_, expr) = dashboard_queries()
        .into_iter()
        .find(|(panel, _)| *panel == label)
        .unwrap_or_else(|| panic!("the dashboard has no target {label}"));
    substitute(&expr)
}

/// The expression of the alert `name`.
pub fn alert_expr(name: &str) -> String {
    alert_rules()
        .into_iter()
        .find(|(alert, _)| alert == name)
        .unwrap_or_else(|| panic!("alerts.yml has no alert {name}"))
        .1
}

/// Each sample of an instant query: (its labels as `k=v,...`, its value).
pub fn samples(prometheus: &Prometheus, expr: &str) -> Vec<(String, f64)> {
    let result = prometheus
        .query(expr)
        .unwrap_or_else(|e| panic!("`{expr}` failed: {e}"));
    result
        .iter()
        .map(|sample| {
            let labels = sample["metric"]
                .as_object()
                .map(|m| {
                    let mut pairs: Vec<String> = m
                        .iter()
                        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("?")))
                        .collect();
                    pairs.sort();
                    pairs.join(",")
                })
                .unwrap_or_default();
            let value = sample["value"][1]
                .as_str()
                .and_then(|v| v.parse().ok())
                .unwrap_or(f64::NAN);
            (labels, value)
        })
        .collect()
}

/// The value of the sample whose labels are exactly `labels` (sorted `k=v`, comma-joined).
pub fn value_of(samples: &[(String, f64)], labels: &str) -> Option<f64> {
    samples.iter().find(|(l, _)| l == labels).map(|(_, v)| *v)
}
