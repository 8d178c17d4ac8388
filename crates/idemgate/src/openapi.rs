//! `idemgate openapi`: an OpenAPI 3.1 document of the client-facing routes (SPEC 12).
//!
//! Every operation carries `x-idempotency: {policy, scope, retention, recovery}` and, where the
//! policy reads it, the `Idempotency-Key` header parameter, so public docs and generated SDKs
//! state the policy class of every endpoint. A `/**` suffix route is written as a
//! `{path}` parameter with `x-idemgate-wildcard: true`, since OpenAPI has no suffix wildcard.

use serde_json::{Value, json};

use crate::config::{Config, PolicyKind, Route};

/// Builds the document.
#[must_use]
pub fn document(config: &Config) -> Value {
    let mut paths = serde_json::Map::new();
    for route in config.routes.iter() {
        let (path, wildcard) = openapi_path(&route.path.to_string());
        let item = paths.entry(path.clone()).or_insert_with(|| json!({}));
        for method in &route.methods.0 {
            let name = method.as_str().to_ascii_lowercase();
            // First match wins at runtime, so an earlier route owns a (path, method) pair.
            if item.get(&name).is_none() {
                // operationIds must be unique: a route answering several methods gets one each.
                let id = if route.methods.0.len() == 1 {
                    route.id.to_string()
                } else {
                    format!("{}-{name}", route.id)
                };
                item[name] = operation(route, &id, &path, wildcard);
            }
        }
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "API behind idemgate",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Client-facing routes with their idempotency policy (x-idempotency)."
        },
        "paths": paths,
        "components": {
            "schemas": {
                "Problem": {
                    "type": "object",
                    "description": "RFC 9457 problem details written by idemgate.",
                    "required": ["type", "title", "status"],
                    "properties": {
                        "type": {"type": "string", "format": "uri"},
                        "title": {"type": "string"},
                        "status": {"type": "integer"},
                        "detail": {"type": "string"},
                        "operation_id": {"type": "string"},
                        "reason": {"type": "string", "enum": ["length", "charset", "reserved_prefix", "syntax"]}
                    }
                }
            }
        }
    })
}

fn openapi_path(template: &str) -> (String, bool) {
    match template.strip_suffix("/**") {
        Some(prefix) => (format!("{prefix}/{{path}}"), true),
        None => (template.to_owned(), false),
    }
}

fn policy_name(p: PolicyKind) -> &'static str {
    match p {
        PolicyKind::Required => "required",
        PolicyKind::Accepted => "accepted",
        PolicyKind::Prohibited => "prohibited",
        PolicyKind::Webhook => "webhook",
        PolicyKind::HandlerInternal => "handler_internal",
    }
}

fn operation(route: &Route, operation_id: &str, path: &str, wildcard: bool) -> Value {
    let mut params: Vec<Value> = path
        .split('/')
        .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
        .collect();
    let deduplicated = matches!(route.policy, PolicyKind::Required | PolicyKind::Accepted);
    if deduplicated {
        params.push(json!({
            "name": route.header.as_str(),
            "in": "header",
            "required": route.policy == PolicyKind::Required,
            "description": "One key per logical operation, reused on every retry of it.",
            "schema": {"type": "string", "maxLength": route.keys.max_len, "pattern": route.keys.pattern.as_str()}
        }));
    }
    let mut responses = serde_json::Map::new();
    let problem = |d: &str| json!({"description": d, "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}});
    responses.insert(
        "default".into(),
        json!({"description": "The upstream's response."}),
    );
    match route.policy {
        PolicyKind::Required | PolicyKind::Accepted => {
            responses.insert(
                "400".into(),
                problem("missing-idempotency-key or invalid-idempotency-key"),
            );
            responses.insert(
                "409".into(),
                problem("request-in-flight, response-not-retained or outcome-unknown"),
            );
            responses.insert("422".into(), problem("idempotency-key-reused"));
            responses.insert("503".into(), problem("store-unavailable"));
        }
        PolicyKind::Prohibited => {
            responses.insert("400".into(), problem("idempotency-key-not-allowed"));
        }
        PolicyKind::Webhook | PolicyKind::HandlerInternal => {}
    }
    let mut op = json!({
        "operationId": operation_id,
        "parameters": params,
        "responses": responses,
        "x-idempotency": {
            "policy": policy_name(route.policy),
            "scope": route.scope.as_str(),
            "retention": humantime::format_duration(route.engine.retention).to_string(),
            "recovery": false
        }
    });
    if wildcard {
        op["x-idemgate-wildcard"] = json!(true);
    }
    op
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_states_its_policy() {
        let config = Config::from_yaml(include_str!("../examples/demo.yaml")).unwrap();
        let doc = document(&config);
        let create = &doc["paths"]["/api/v1/orders"]["post"];
        assert_eq!(create["x-idempotency"]["policy"], "required");
        assert_eq!(create["x-idempotency"]["retention"], "1day");
        let header = create["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["in"] == "header")
            .unwrap();
        assert_eq!(header["name"], "idempotency-key");
        assert_eq!(header["required"], true);
        let refund = &doc["paths"]["/api/v1/orders/{order_id}/refunds"]["post"];
        assert_eq!(refund["parameters"][0]["name"], "order_id");
        assert_eq!(refund["x-idempotency"]["retention"], "30days");
        let search = &doc["paths"]["/api/v1/search"]["post"];
        assert_eq!(search["x-idempotency"]["policy"], "prohibited");
        assert!(search["parameters"].as_array().unwrap().is_empty());
        let rest = &doc["paths"]["/{path}"];
        assert_eq!(rest["patch"]["x-idemgate-wildcard"], true);
        assert_eq!(
            rest["post"]["parameters"][1]["required"], false,
            "accepted: optional key"
        );
    }
}
