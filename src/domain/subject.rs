//! NATS subject rules: which subjects may be published to, and wildcard matching.
//!
//! May import: the rest of `domain` only.

/// A concrete subject a client may publish to: dot-separated non-empty tokens, no
/// wildcards, no whitespace, and not in the `$` system namespaces.
pub(crate) fn validate_publish_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty() {
        return Err("must not be empty".into());
    }
    if subject.len() > 512 {
        return Err("must be at most 512 bytes".into());
    }
    if subject.starts_with('$') {
        return Err("must not be a system subject (starting with $)".into());
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Err("must not have empty tokens (leading, trailing or double dots)".into());
        }
        if token == "*" || token == ">" {
            return Err("must not contain wildcards".into());
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("must not contain whitespace or control characters".into());
        }
    }
    Ok(())
}

/// A stream or consumer name as NATS accepts it: 1 to 255 characters, none of them
/// whitespace, a control character, `.`, `*`, `>`, `/` or `\` (names become subject tokens
/// and file names on the server).
pub(crate) fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.chars().count() > 255 {
        return Err("must be at most 255 characters".into());
    }
    if let Some(bad) = name
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
    {
        return Err(format!(
            "must not contain {bad:?} (no whitespace, '.', '*', '>', '/' or '\\')"
        ));
    }
    Ok(())
}

/// A subject filter: dot-separated non-empty tokens without whitespace, where `*` may stand
/// for a whole token and `>` for the last one.
pub(crate) fn validate_filter(filter: &str) -> Result<(), String> {
    if filter.is_empty() {
        return Err("must not be empty".into());
    }
    let tokens: Vec<&str> = filter.split('.').collect();
    for (index, token) in tokens.iter().enumerate() {
        if token.is_empty() {
            return Err("must not have empty tokens (leading, trailing or double dots)".into());
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("must not contain whitespace or control characters".into());
        }
        if token.len() > 1 && token.contains(['*', '>']) {
            return Err(format!("wildcards must be whole tokens, got {token:?}"));
        }
        if *token == ">" && index + 1 != tokens.len() {
            return Err("'>' may only be the last token".into());
        }
    }
    Ok(())
}

/// Whether `subject` matches the subject filter `filter` (`*` one token, `>` the rest).
pub(crate) fn matches(filter: &str, subject: &str) -> bool {
    let mut filter_tokens = filter.split('.');
    let mut subject_tokens = subject.split('.');
    loop {
        match (filter_tokens.next(), subject_tokens.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(f), Some(s)) if f == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_filters_follow_the_nats_rules() {
        assert!(validate_name("ORDERS").is_ok());
        assert!(validate_name("billing-v2_x").is_ok());
        for bad in ["", "bad name", "a.b", "a*", "a>", "a/b", "a\\b", "tab\t"] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        for good in ["orders.>", "orders.*.created", "*", ">", "a.b.c"] {
            assert!(validate_filter(good).is_ok(), "{good:?}");
        }
        for bad in [
            "",
            "orders.",
            ".orders",
            "a..b",
            "orders.>.x",
            "or*ders",
            "a b",
        ] {
            assert!(validate_filter(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn wildcards_match_like_nats() {
        assert!(matches("orders.>", "orders.created"));
        assert!(matches("orders.>", "orders.eu.created"));
        assert!(!matches("orders.>", "orders"));
        assert!(matches("orders.*", "orders.created"));
        assert!(!matches("orders.*", "orders.eu.created"));
        assert!(matches("orders.created", "orders.created"));
        assert!(!matches("orders.created", "orders.deleted"));
        assert!(!matches("orders.*.x", "orders.a"));
    }

    #[test]
    fn publish_subjects_are_concrete() {
        assert!(validate_publish_subject("orders.created").is_ok());
        assert!(validate_publish_subject("").is_err());
        assert!(validate_publish_subject("orders.*").is_err());
        assert!(validate_publish_subject("orders.>").is_err());
        assert!(validate_publish_subject("orders..x").is_err());
        assert!(validate_publish_subject("orders. x").is_err());
        assert!(validate_publish_subject("$JS.API.STREAM.DELETE.ORDERS").is_err());
    }
}
