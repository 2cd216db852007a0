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
