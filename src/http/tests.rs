//! Unit tests of `http` (kept apart so that the module itself stays short).

/// Every operation behind authentication says so (bearer, with its scope) and lists
/// 401 and 403; the open ones list neither and declare `security: []`.
#[test]
fn the_spec_declares_who_may_call_what() {
    let spec = serde_json::to_value(super::openapi()).expect("spec serializes");
    let scheme = &spec["components"]["securitySchemes"]["bearer"];
    assert_eq!(scheme["scheme"], "bearer", "{scheme}");
    let paths = spec["paths"].as_object().expect("paths");
    for (path, item) in paths {
        for (method, operation) in item.as_object().expect("path item") {
            let open =
                crate::http::scopes::requirement(path) == crate::http::scopes::Requirement::Open;
            let responses = &operation["responses"];
            let guarded = responses.get("401").is_some() && responses.get("403").is_some();
            assert_eq!(
                guarded, !open,
                "{method} {path}: 401/403 listed iff protected"
            );
            // An open operation has an empty list: "no requirement".
            let requirements = operation["security"].as_array().map(Vec::len);
            if open {
                assert_eq!(requirements, Some(0), "{method} {path}");
            } else {
                assert!(requirements.is_some_and(|n| n >= 1), "{method} {path}");
            }
        }
    }
    assert_eq!(
        spec["paths"]["/fetch"]["post"]["security"],
        serde_json::json!([{ "bearer": ["fetch"] }])
    );
    // `publish` or `admin`: two alternative requirements.
    assert_eq!(
        spec["paths"]["/publish"]["post"]["security"],
        serde_json::json!([{ "bearer": ["publish"] }, { "bearer": ["admin"] }])
    );
}

/// The committed spec (what client generators read) must be the one the code serves.
/// Regenerate with `UPDATE_OPENAPI=1 cargo test --lib committed_spec`.
#[test]
fn committed_spec_matches_the_code() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi/openapi.json");
    let generated =
        serde_json::to_string_pretty(&super::openapi()).expect("spec serializes") + "\n";
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::create_dir_all(path.parent().expect("has a parent")).expect("mkdir openapi/");
        std::fs::write(&path, &generated).expect("write openapi/openapi.json");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "openapi/openapi.json is out of date; run UPDATE_OPENAPI=1 cargo test --lib committed_spec"
    );
}

/// Every `$ref` of the spec names a schema it has: a generator (openapi-typescript, redocly)
/// refuses the whole spec for one that does not.
#[test]
fn every_reference_in_the_spec_resolves() {
    fn references<'a>(value: &'a serde_json::Value, found: &mut Vec<&'a str>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("$ref", serde_json::Value::String(target)) => found.push(target),
                        _ => references(value, found),
                    }
                }
            }
            serde_json::Value::Array(items) => {
                for item in items {
                    references(item, found);
                }
            }
            _ => {}
        }
    }
    let spec = serde_json::to_value(super::openapi()).expect("spec serializes");
    let mut found = Vec::new();
    references(&spec, &mut found);
    assert!(!found.is_empty(), "the spec has references");
    for target in found {
        let pointer = target.strip_prefix('#').unwrap_or(target);
        assert!(
            spec.pointer(pointer).is_some(),
            "{target} names nothing in the spec"
        );
    }
}
