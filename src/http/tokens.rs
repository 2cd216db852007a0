//! The static bearer tokens: read from `--auth-tokens-file` and `--auth-tokens` (lines or
//! JSON, each token with its scopes), kept as SHA-256 digests, and looked up in constant
//! time. Errors name the entry, never its token.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;

use anyhow::Context as _;
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::principal::Account;
use super::scopes::Grants;
#[cfg(test)]
use super::scopes::Scope;
use crate::config::Config;

/// One configured token: its digest, scopes, and its account.
pub(crate) struct TokenEntry {
    pub(super) digest: [u8; 32],
    pub(super) grants: Arc<Grants>,
    pub(super) account: Arc<Account>,
}

impl TokenEntry {
    #[cfg(test)]
    fn allows(&self, scope: Scope) -> bool {
        self.grants.allows(scope)
    }
}

/// The configured tokens (none configured: authentication by static token is off).
pub(crate) struct Tokens {
    pub(super) entries: Vec<Arc<TokenEntry>>,
}

impl Tokens {
    /// Parse token entries. Lines: `<token> <scope>[,<scope>…]` (or `<token>:<scopes>`;
    /// scopes separated by commas or spaces), `;` also ending an entry where `separators`
    /// says so, blank lines and `#` comments ignored. Or JSON: `{"<token>": [scopes]}`,
    /// `[{"token": …, "scopes": […]}]` or `{"tokens": [that array]}` (scopes as an array or
    /// a comma-separated string). Errors name the entry by `source:number`, never its token.
    pub(crate) fn parse(text: &str, source: &str, separators: &[char]) -> Result<Self, String> {
        let trimmed = text.trim_start();
        let raw = if trimmed.starts_with('{') || trimmed.starts_with('[') {
            json_entries(trimmed, source)?
        } else {
            line_entries(text, source, separators)
        };
        let mut entries = Vec::with_capacity(raw.len());
        for RawEntry {
            origin,
            token,
            scopes,
        } in raw
        {
            if !is_b64token(&token) {
                return Err(format!(
                    "{origin}: a token may hold only letters, digits and -._~+/ (then =)"
                ));
            }
            if scopes.is_empty() {
                return Err(format!(
                    "{origin}: no scopes for the token (expected fetch, settle, publish, admin or *)"
                ));
            }
            let mut granted = Grants::default();
            for scope in &scopes {
                granted
                    .grant(scope)
                    .map_err(|why| format!("{origin}: {why}"))?;
            }
            entries.push(Arc::new(TokenEntry {
                digest: Sha256::digest(token.as_bytes()).into(),
                grants: Arc::new(granted),
                account: Arc::default(),
            }));
        }
        Ok(Self { entries })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// The entry of a presented token. Looks at every entry whatever matches, comparing
    /// fixed-size digests in constant time.
    pub(crate) fn authenticate(&self, presented: &str) -> Option<Arc<TokenEntry>> {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let mut found = u32::MAX;
        for (index, entry) in self.entries.iter().enumerate() {
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            found.conditional_assign(&index, digest.ct_eq(&entry.digest));
        }
        self.entries.get(found as usize).cloned()
    }
}

/// One entry as written, before validation.
struct RawEntry {
    origin: String,
    token: String,
    scopes: Vec<String>,
}

fn split_scopes(text: &str) -> Vec<String> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|scope| !scope.is_empty())
        .map(str::to_owned)
        .collect()
}

fn line_entries(text: &str, source: &str, separators: &[char]) -> Vec<RawEntry> {
    let mut entries = Vec::new();
    for (index, line) in text.split(separators).enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let (first, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        // `token:scopes` (`:` is not a token character, so this is unambiguous).
        let (token, scopes) = match first.split_once(':') {
            Some((token, scopes)) => (token, format!("{scopes} {rest}")),
            None => (first, rest.to_owned()),
        };
        entries.push(RawEntry {
            origin: format!("{source}:{}", index + 1),
            token: token.to_owned(),
            scopes: split_scopes(&scopes),
        });
    }
    entries
}

fn json_entries(text: &str, source: &str) -> Result<Vec<RawEntry>, String> {
    use serde_json::Value;
    // serde_json's message names a position, never the input.
    let value: Value =
        serde_json::from_str(text).map_err(|err| format!("{source}: not valid JSON: {err}"))?;
    let scopes_of = |origin: &str, scopes: Option<&Value>| match scopes {
        Some(Value::String(text)) => Ok(split_scopes(text)),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                item.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("{origin}: scopes must be strings"))
            })
            .collect(),
        Some(_) => Err(format!("{origin}: scopes must be an array or a string")),
        None => Ok(Vec::new()),
    };
    let listed = |items: &[Value]| {
        items
            .iter()
            .enumerate()
            .map(|(index, item)| {
                let origin = format!("{source}: entry {}", index + 1);
                let token = item
                    .get("token")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("{origin}: no \"token\" string"))?;
                Ok(RawEntry {
                    scopes: scopes_of(&origin, item.get("scopes"))?,
                    token: token.to_owned(),
                    origin,
                })
            })
            .collect::<Result<Vec<_>, String>>()
    };
    match &value {
        Value::Array(items) => listed(items),
        Value::Object(map) => match map.get("tokens") {
            Some(Value::Array(items)) if map.len() == 1 => listed(items),
            _ => map
                .iter()
                .enumerate()
                .map(|(index, (token, scopes))| {
                    let origin = format!("{source}: entry {}", index + 1);
                    Ok(RawEntry {
                        scopes: scopes_of(&origin, Some(scopes))?,
                        token: token.clone(),
                        origin,
                    })
                })
                .collect(),
        },
        _ => Err(format!(
            "{source}: expected a JSON object or array of tokens"
        )),
    }
}

/// RFC 6750 `b64token`: what may follow `Bearer ` in an Authorization header.
fn is_b64token(token: &str) -> bool {
    let body = token.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || b"-._~+/".contains(&byte))
}

/// The tokens of --auth-tokens-file and --auth-tokens together; `None` when neither is given.
pub(super) fn load_tokens(config: &Config) -> anyhow::Result<Option<Tokens>> {
    if config.auth_tokens_file.is_none() && config.auth_tokens.is_none() {
        return Ok(None);
    }
    let mut entries = Vec::new();
    if let Some(path) = &config.auth_tokens_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --auth-tokens-file {}", path.display()))?;
        let tokens = Tokens::parse(&text, &path.display().to_string(), &['\n'])
            .map_err(|why| anyhow::anyhow!("--auth-tokens-file {why}"))?;
        entries.extend(tokens.entries);
    }
    if let Some(inline) = &config.auth_tokens {
        let tokens = Tokens::parse(inline.expose(), "RUSTSTREAM_AUTH_TOKENS", &[';', '\n'])
            .map_err(|why| anyhow::anyhow!("--auth-tokens {why}"))?;
        entries.extend(tokens.entries);
    }
    if entries.is_empty() {
        anyhow::bail!(
            "authentication is configured but names no token: every request would be refused"
        );
    }
    Ok(Some(Tokens { entries }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(text: &str) -> Tokens {
        Tokens::parse(text, "test", &['\n', ';']).expect("parses")
    }

    #[test]
    fn parses_entries_comments_and_wildcards() {
        let tokens = tokens(
            "# operators\nworker-token-1 fetch,settle\n\n ops-token admin # dashboards\nroot *; pub publish",
        );
        assert_eq!(tokens.len(), 4);
        let worker = tokens.authenticate("worker-token-1").expect("known");
        assert!(worker.allows(Scope::Fetch) && worker.allows(Scope::Settle));
        assert!(!worker.allows(Scope::Admin) && !worker.allows(Scope::Publish));
        let ops = tokens.authenticate("ops-token").expect("known");
        assert!(ops.allows(Scope::Admin) && !ops.allows(Scope::Fetch));
        assert!(ops.allows(Scope::Publish), "admin may publish too");
        assert!(!ops.allows(Scope::Settle));
        let root = tokens.authenticate("root").expect("known");
        assert!(Scope::ALL.iter().all(|scope| root.allows(*scope)));
        assert!(
            tokens
                .authenticate("pub")
                .expect("known")
                .allows(Scope::Publish)
        );
        assert!(
            tokens.authenticate("worker-token").is_none(),
            "a prefix is not the token"
        );
        assert!(tokens.authenticate("").is_none());
    }

    #[test]
    fn json_and_colon_forms_parse_too() {
        for text in [
            r#"{"tok-a": ["fetch", "settle"], "tok-b": "admin"}"#,
            r#"[{"token": "tok-a", "scopes": "fetch,settle"}, {"token": "tok-b", "scopes": ["admin"]}]"#,
            r#"{"tokens": [{"token": "tok-a", "scopes": ["fetch", "settle"]}, {"token": "tok-b", "scopes": ["admin"]}]}"#,
            "tok-a:fetch,settle\ntok-b: admin",
            "tok-a fetch settle\ntok-b admin",
        ] {
            let tokens = tokens(text);
            assert_eq!(tokens.len(), 2, "{text}");
            let a = tokens.authenticate("tok-a").expect("tok-a");
            assert!(a.allows(Scope::Fetch) && a.allows(Scope::Settle) && !a.allows(Scope::Admin));
            let b = tokens.authenticate("tok-b").expect("tok-b");
            assert!(b.allows(Scope::Admin) && !b.allows(Scope::Fetch), "{text}");
        }
        for bad in [
            r#"{"secret-tok": 5}"#,
            r#"[{"scopes": ["fetch"]}]"#,
            "[1",
            r#""secret-tok""#,
        ] {
            let err = Tokens::parse(bad, "test", &['\n']).err().expect("refused");
            assert!(!err.contains("secret-tok"), "{err}");
        }
    }

    #[test]
    fn errors_name_the_line_never_the_token() {
        for (text, line) in [
            ("good fetch\nsecret-one fech", "test:2"),
            ("secret-two", "test:1"),
            ("secret\"three fetch", "test:1"),
        ] {
            let err = Tokens::parse(text, "test", &['\n']).err().expect("refused");
            assert!(err.starts_with(line), "{err}");
            assert!(!err.contains("secret"), "the error shows the token: {err}");
        }
    }
}
