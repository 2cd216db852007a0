//! The documentation holds together: every relative link in README.md, CHANGELOG.md and
//! docs/*.md names a file that exists, every `#anchor` a heading of its page (as GitHub makes
//! anchors), and the README links every docs page, so a reader finds each one by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The repository root; a link is resolved from the folder of the page that holds it.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md, CHANGELOG.md and every docs/*.md (in name order).
fn pages() -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("read docs/")
        .map(|entry| entry.expect("a docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    let mut pages = vec![root().join("README.md"), root().join("CHANGELOG.md")];
    pages.extend(docs);
    pages
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
}

/// A page's path from the repository root, for messages.
fn shown(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .to_string_lossy()
        .replace('\\', "/")
}

/// Whether a line opens or closes a fenced code block (also indented, inside a list item).
fn is_fence(line: &str) -> bool {
    line.trim_start().starts_with("```")
}

/// The lines of a page outside fenced code blocks, numbered from 1, with code spans blanked
/// out: a `[text](target)` in code is no link. A code span may wrap onto the next line, not
/// past a blank one.
fn prose(text: &str) -> Vec<(usize, String)> {
    let mut lines = Vec::new();
    let mut in_fence = false;
    let mut in_code = false;
    for (index, line) in text.lines().enumerate() {
        if is_fence(line) {
            in_fence = !in_fence;
            in_code = false;
            continue;
        }
        if in_fence {
            continue;
        }
        if line.trim().is_empty() {
            in_code = false;
        }
        let mut kept = String::with_capacity(line.len());
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
                kept.push(' ');
            } else if in_code {
                kept.push(' ');
            } else {
                kept.push(c);
            }
        }
        lines.push((index + 1, kept));
    }
    lines
}

/// One inline link (or image) of a page: the line it is on and its target as written.
#[derive(Debug)]
struct Link {
    line: usize,
    target: String,
}

/// Every `[text](target)` of a page (a title after the target is left out).
fn links(text: &str) -> Vec<Link> {
    let mut links = Vec::new();
    for (line, kept) in prose(text) {
        let mut rest = kept.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or_default();
            links.push(Link {
                line,
                target: target.to_owned(),
            });
            rest = &after[end..];
        }
    }
    links
}

/// GitHub's anchor for a heading: lowercase, spaces become `-`, and only alphanumerics, `-`
/// and `_` are kept.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings, in order; a heading seen before gets `-1`, `-2`, … as
/// on GitHub.
fn anchors(text: &str) -> Vec<String> {
    let mut anchors = Vec::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut in_fence = false;
    for line in text.lines() {
        if is_fence(line) {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        // `#word` is no heading; `# word` (up to six `#`) is.
        if !heading.starts_with(' ') || line.len() - heading.len() > 6 {
            continue;
        }
        let base = slug(heading.trim().trim_end_matches('#'));
        let count = seen.entry(base.clone()).or_insert(0);
        anchors.push(if *count == 0 {
            base
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    anchors
}

/// Whether a link target is outside the repository (not checked here).
fn is_external(target: &str) -> bool {
    ["http://", "https://", "mailto:"]
        .iter()
        .any(|scheme| target.starts_with(scheme))
}

/// Checks one relative target of `page`: its file (empty: the page itself) exists and, with
/// an `#anchor`, is a markdown page with a heading of that anchor.
fn check(page: &Path, target: &str) -> Result<(), String> {
    let (file, anchor) = match target.split_once('#') {
        Some((file, anchor)) => (file, Some(anchor)),
        None => (target, None),
    };
    if file.is_empty() && anchor.is_none_or(str::is_empty) {
        return Err("empty link target".to_owned());
    }
    let path = if file.is_empty() {
        page.to_path_buf()
    } else {
        page.parent().expect("a page is in a folder").join(file)
    };
    if !path.exists() {
        return Err(format!("{} does not exist", shown(&path)));
    }
    let Some(anchor) = anchor else {
        return Ok(());
    };
    if path.extension().is_none_or(|ext| ext != "md") {
        return Err(format!(
            "#{anchor} points into {}, which is no markdown page",
            shown(&path)
        ));
    }
    let found = anchors(&read(&path));
    if found.iter().any(|known| known == anchor) {
        Ok(())
    } else {
        Err(format!(
            "{} has no heading with the anchor #{anchor} (it has {found:?})",
            shown(&path)
        ))
    }
}

#[test]
fn every_relative_link_resolves() {
    let mut checked = 0;
    let mut broken = Vec::new();
    for page in pages() {
        for link in links(&read(&page)) {
            if is_external(&link.target) {
                continue;
            }
            checked += 1;
            if let Err(problem) = check(&page, &link.target) {
                broken.push(format!(
                    "{}:{}: ({}) {problem}",
                    shown(&page),
                    link.line,
                    link.target
                ));
            }
        }
    }
    assert!(checked > 0, "no relative link found in the documentation");
    assert!(
        broken.is_empty(),
        "{} of {checked} relative links are broken:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

#[test]
fn the_readme_links_every_docs_page() {
    let readme = root().join("README.md");
    let mut linked = Vec::new();
    for link in links(&read(&readme)) {
        if is_external(&link.target) {
            continue;
        }
        let file = link
            .target
            .split_once('#')
            .map_or(link.target.as_str(), |(file, _)| file);
        linked.push(shown(&root().join(file)));
    }
    let unlinked: Vec<String> = pages()
        .into_iter()
        .map(|page| shown(&page))
        .filter(|page| page != "README.md" && !linked.contains(page))
        .collect();
    assert!(
        unlinked.is_empty(),
        "README.md links none of {unlinked:?}: add them to its Documentation list"
    );
}

#[test]
fn anchors_are_made_as_on_github() {
    assert_eq!(
        anchors("# Leases and guarantees\n## Status codes\n```sh\n# not a heading\n```\n"),
        ["leases-and-guarantees", "status-codes"]
    );
    assert_eq!(
        anchors("## Shutdown, reload, health and logs\n## `POST /fetch` (v2)\n#tag\n"),
        ["shutdown-reload-health-and-logs", "post-fetch-v2"]
    );
    assert_eq!(anchors("## Notes\n## Notes\n"), ["notes", "notes-1"]);
}
