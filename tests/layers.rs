//! The import graph of the crate holds its layers (README, "Architecture"):
//!
//! ```text
//! model -> plan -> storage, comm, devmem -> engines (in ENGINES order) -> front doors
//! ```
//!
//! The test reads every `.rs` file of the library (`src/`), of the CLI (`src/bin/*`) and of the
//! Python extension (`python/src/`), collects the paths that name this crate's modules (`use`
//! trees and inline `crate::`, `super::`, `self::` paths; `super::` resolved; re-exports
//! (`pub use`) followed to the module that defines the item), and fails, with the list of
//! file:line sites, on
//! - an upward import: a library module importing a module of a higher layer, or an engine
//!   importing an engine that comes later in [`ENGINES`];
//! - a top-level module of the library that no layer lists (a new module must be placed);
//! - a cycle: in every crate, at every level of the module tree, the children of one module
//!   must import each other without a cycle (a module may use its parent, which declares it and
//!   re-exports it, and its own children: those edges are not counted).
//!
//! Run it with `cargo test --test layers`; `-- --nocapture` also prints the top-level graph.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The library's layers, lowest first; a module may import only modules of its own layer or
/// of lower ones (within the engine layer, see [`ENGINES`]).
const LAYERS: &[(&str, &[&str])] = &[
    ("model", &["model"]),
    ("plan", &["plan"]),
    ("io", &["storage", "comm", "devmem"]),
    ("engines", ENGINES),
];

/// The engines, lowest first: an engine may import only the engines before it. `error` (the
/// crate-level `Error`) and `coord` (the agreement every collective engine runs) come first;
/// the read and write engines next; what is built on them (device transfers, conversion,
/// live transfer, the manager) last.
const ENGINES: &[&str] = &[
    "error",
    "coord",
    "objects",
    "load",
    "device",
    "stage",
    "save",
    "async_save",
    "checkpoint",
    "remote",
    "state",
    "manager",
    "convert",
    "transfer",
];

/// Cycles that are known and owned by another piece of work: the test reports them but does
/// not fail on them, and fails once one of them is gone (so that this list is cleared).
/// Empty: the storage seam removed the last ones.
const KNOWN_CYCLES: &[&[&str]] = &[];

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Tokens of Rust source with their line numbers: identifiers, `::` and single punctuation;
/// comments, string, byte-string, raw-string and char literals and numbers are dropped.
fn lex(src: &str) -> Vec<(Tok, usize)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let count = |s: &[u8]| s.iter().filter(|&&c| c == b'\n').count();
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let (start, mut depth) = (i, 0);
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            line += count(&b[start..i]);
        } else if let Some(end) = raw_string_end(b, i) {
            line += count(&b[i..end]);
            i = end;
        } else if c == b'"' || (c == b'b' && b.get(i + 1) == Some(&b'"')) {
            let start = i;
            i += if c == b'b' { 2 } else { 1 };
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            line += count(&b[start..i.min(b.len())]);
        } else if c == b'\'' || (c == b'b' && b.get(i + 1) == Some(&b'\'')) {
            // A char literal ('x', '\n', '\u{..}', b'x') or a lifetime ('a).
            let j = if c == b'b' { i + 1 } else { i };
            if b.get(j + 1) == Some(&b'\\') {
                let mut k = j + 2;
                while k < b.len() && b[k] != b'\'' {
                    k += 1;
                }
                i = k + 1;
            } else if b.get(j + 2) == Some(&b'\'') {
                i = j + 3;
            } else {
                // Lifetime, or a multi-byte char: skip the quote and what follows it.
                let ch_len = src[j + 1..].chars().next().map_or(1, char::len_utf8);
                if b.get(j + 1 + ch_len) == Some(&b'\'') {
                    i = j + 2 + ch_len;
                } else {
                    i = j + 1;
                    while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                        i += 1;
                    }
                }
            }
        } else if c.is_ascii_digit() {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == b'_' || c == b'$' {
            let start = i;
            i += 1;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            let mut word = &src[start..i];
            if let Some(w) = word.strip_prefix("r#") {
                word = w;
            }
            out.push((Tok::Ident(word.replace("$crate", "crate")), line));
        } else if b[i..].starts_with(b"::") {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            let ch = src[i..].chars().next().unwrap_or(' ');
            out.push((Tok::Punct(ch), line));
            i += ch.len_utf8();
        }
    }
    out
}

/// Where a raw (byte) string literal starting at `i` ends, if one starts there.
fn raw_string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i;
    if b.get(j) == Some(&b'b') {
        j += 1;
    }
    if b.get(j) != Some(&b'r') || (i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
    {
        return None;
    }
    j += 1;
    let hashes = b[j..].iter().take_while(|&&c| c == b'#').count();
    j += hashes;
    if b.get(j) != Some(&b'"') {
        return None;
    }
    j += 1;
    let close: Vec<u8> = std::iter::once(b'"')
        .chain(std::iter::repeat_n(b'#', hashes))
        .collect();
    while j < b.len() && !b[j..].starts_with(&close) {
        j += 1;
    }
    Some((j + close.len()).min(b.len()))
}

/// One path a file names: the segments as written, the alias (`as x`), whether it is a glob,
/// the line, and whether it comes from a `pub use` (a re-export).
#[derive(Debug, Clone)]
struct Ref {
    segs: Vec<String>,
    alias: Option<String>,
    glob: bool,
    line: usize,
    reexport: bool,
    in_use: bool,
    /// The inline module path (`mod tests { .. }`) inside the file, for `super::`.
    inline: Vec<String>,
}

/// Parses a use tree at `toks[*i]` (after `use` or at a path start), appending every leaf path.
fn use_tree(
    toks: &[(Tok, usize)],
    i: &mut usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, Option<String>, bool)>,
) {
    let mut segs = prefix.to_vec();
    if toks.get(*i).map(|t| &t.0) == Some(&Tok::Path) {
        *i += 1; // a leading `::`
    }
    loop {
        match toks.get(*i).map(|t| &t.0) {
            Some(Tok::Ident(w)) if w == "self" && !segs.is_empty() => {
                *i += 1;
            }
            Some(Tok::Ident(w)) => {
                segs.push(w.clone());
                *i += 1;
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((segs, None, true));
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i).map(|t| &t.0) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => {
                            let before = *i;
                            use_tree(toks, i, &segs, out);
                            if *i == before {
                                *i += 1;
                            }
                        }
                    }
                }
            }
            _ => {
                out.push((segs, None, false));
                return;
            }
        }
        match toks.get(*i).map(|t| &t.0) {
            Some(Tok::Path) => *i += 1,
            Some(Tok::Ident(w)) if w == "as" => {
                *i += 1;
                let alias = match toks.get(*i).map(|t| &t.0) {
                    Some(Tok::Ident(a)) => Some(a.clone()),
                    _ => None,
                };
                *i += 1;
                out.push((segs, alias, false));
                return;
            }
            _ => {
                out.push((segs, None, false));
                return;
            }
        }
    }
}

/// Every path a file's tokens name, with the inline module each sits in.
fn refs(toks: &[(Tok, usize)]) -> Vec<Ref> {
    let mut out = Vec::new();
    // (inline module name, brace depth at which it closes)
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        let (t, line) = (&toks[i].0, toks[i].1);
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(w) if w == "mod" => {
                if let (Some((Tok::Ident(name), _)), Some((Tok::Punct('{'), _))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth));
                    depth += 1;
                    i += 3;
                    continue;
                }
            }
            Tok::Ident(w) if w == "use" => {
                let reexport = is_pub(toks, i);
                let mut leaves = Vec::new();
                let mut j = i + 1;
                use_tree(toks, &mut j, &[], &mut leaves);
                for (segs, alias, glob) in leaves {
                    out.push(Ref {
                        segs,
                        alias,
                        glob,
                        line,
                        reexport,
                        in_use: true,
                        inline: inline.iter().map(|(n, _)| n.clone()).collect(),
                    });
                }
                i = j;
                continue;
            }
            Tok::Ident(w)
                if matches!(w.as_str(), "crate" | "super" | "self")
                    && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path)
                    && (i == 0 || toks[i - 1].0 != Tok::Path) =>
            {
                let mut leaves = Vec::new();
                let mut j = i;
                use_tree(toks, &mut j, &[], &mut leaves);
                for (segs, alias, glob) in leaves {
                    out.push(Ref {
                        segs,
                        alias,
                        glob,
                        line,
                        reexport: false,
                        in_use: false,
                        inline: inline.iter().map(|(n, _)| n.clone()).collect(),
                    });
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Whether the `use` at `toks[i]` is `pub` / `pub(..)`.
fn is_pub(toks: &[(Tok, usize)], i: usize) -> bool {
    match i.checked_sub(1).map(|k| &toks[k].0) {
        Some(Tok::Ident(w)) => w == "pub",
        Some(Tok::Punct(')')) => {
            let mut k = i - 1;
            while k > 0 && toks[k].0 != Tok::Punct('(') {
                k -= 1;
            }
            k > 0 && toks[k - 1].0 == Tok::Ident("pub".into())
        }
        _ => false,
    }
}

/// One crate: its files by module path (`[]` is the root file).
struct Crate {
    name: String,
    files: BTreeMap<Vec<String>, (PathBuf, Vec<Ref>)>,
}

fn rs_files(dir: &Path, skip: Option<&Path>, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if Some(p.as_path()) == skip {
            continue;
        }
        if p.is_dir() {
            rs_files(&p, skip, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Reads a crate whose root file is `root` and whose modules live under its directory.
fn read_crate(name: &str, root: &Path, skip: Option<&Path>) -> Crate {
    let dir = root.parent().expect("root file in a directory");
    let mut paths = Vec::new();
    rs_files(dir, skip, &mut paths);
    let mut files = BTreeMap::new();
    for p in paths {
        let rel = p.strip_prefix(dir).expect("under the crate directory");
        let mut module: Vec<String> = rel
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        let last = module.pop().expect("a file name");
        if p != root {
            let stem = last.trim_end_matches(".rs");
            if stem != "mod" {
                module.push(stem.to_owned());
            }
        }
        let src =
            std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
        files.insert(module, (p, refs(&lex(&src))));
    }
    Crate {
        name: name.to_owned(),
        files,
    }
}

impl Crate {
    /// The absolute path (in module segments) a reference names, or `None` for another crate.
    fn absolute(&self, file: &[String], r: &Ref) -> Option<Vec<String>> {
        let mut here: Vec<String> = file.iter().chain(&r.inline).cloned().collect();
        let mut segs = r.segs.iter().peekable();
        match segs.peek().map(|s| s.as_str()) {
            Some("crate") => {
                segs.next();
                here.clear();
            }
            Some("self") => {
                segs.next();
            }
            Some("super") => {
                while segs.peek().map(|s| s.as_str()) == Some("super") {
                    segs.next();
                    here.pop()?;
                }
            }
            // A bare path in a `use`: a child module of the file, else another crate.
            Some(first) if r.in_use => {
                let mut child = file.to_vec();
                child.push(first.to_owned());
                if !self.files.contains_key(&child) {
                    return None;
                }
                here = file.to_vec();
            }
            _ => return None,
        }
        here.extend(segs.cloned());
        Some(here)
    }

    /// The file module that defines what `path` names: the deepest file module it starts with,
    /// following that module's re-exports of the next segment.
    fn resolve(
        &self,
        path: &[String],
        reexports: &HashMap<(Vec<String>, String), Vec<String>>,
    ) -> Vec<String> {
        let mut path = path.to_vec();
        for _ in 0..16 {
            let mut n = path.len();
            while n > 0 && !self.files.contains_key(&path[..n]) {
                n -= 1;
            }
            let module = path[..n].to_vec();
            let Some(next) = path.get(n) else {
                return module;
            };
            match reexports.get(&(module.clone(), next.clone())) {
                Some(target) if target.as_slice() != path.as_slice() => {
                    let mut p = target.clone();
                    p.extend(path[n + 1..].iter().cloned());
                    path = p;
                }
                _ => return module,
            }
        }
        path
    }

    /// Every edge between file modules: (from, to, file, line).
    fn edges(&self) -> Vec<(Vec<String>, Vec<String>, PathBuf, usize)> {
        let mut reexports = HashMap::new();
        for (module, (_, refs)) in &self.files {
            for r in refs
                .iter()
                .filter(|r| r.reexport && !r.glob && r.inline.is_empty())
            {
                if let Some(abs) = self.absolute(module, r) {
                    let name = r.alias.clone().or_else(|| abs.last().cloned());
                    if let Some(name) = name {
                        reexports.insert((module.clone(), name), abs);
                    }
                }
            }
        }
        let mut out = Vec::new();
        for (module, (file, refs)) in &self.files {
            for r in refs {
                if let Some(abs) = self.absolute(module, r) {
                    let to = self.resolve(&abs, &reexports);
                    if &to != module {
                        out.push((module.clone(), to, file.clone(), r.line));
                    }
                }
            }
        }
        out
    }
}

fn show(m: &[String]) -> String {
    if m.is_empty() {
        "(root)".into()
    } else {
        m.join("::")
    }
}

/// Strongly connected components with more than one node (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct St<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: HashMap<&'a str, usize>,
        low: HashMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut St<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        for w in s.g.get(v).into_iter().flatten() {
            if !s.index.contains_key(w.as_str()) {
                visit(s, w);
                let lw = s.low[w.as_str()];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(w.as_str()) {
                let iw = s.index[w.as_str()];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = St {
        g: graph,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Problems of one crate (cycles among siblings and, for the library, layer violations), the
/// known cycles seen, and the top-level graph.
type Checked = (
    Vec<String>,
    Vec<Vec<String>>,
    BTreeMap<String, BTreeSet<String>>,
);

/// Checks one crate (the layers only where `layered`).
fn check(c: &Crate, layered: bool) -> Checked {
    let mut problems = Vec::new();
    let edges = c.edges();
    // Sibling graphs: parent -> (child -> children it imports), with the sites of each edge.
    let mut graphs: BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut sites: BTreeMap<(Vec<String>, String, String), BTreeSet<String>> = BTreeMap::new();
    for (from, to, file, line) in &edges {
        let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        if common == from.len() || common == to.len() {
            continue; // a module and its parent or child
        }
        let parent = from[..common].to_vec();
        let (a, b) = (from[common].clone(), to[common].clone());
        graphs
            .entry(parent.clone())
            .or_default()
            .entry(a.clone())
            .or_default()
            .insert(b.clone());
        sites.entry((parent, a, b)).or_default().insert(format!(
            "{}:{line} ({} -> {})",
            file.display(),
            show(from),
            show(to)
        ));
    }
    let mut known_seen = Vec::new();
    for (parent, g) in &graphs {
        for comp in cycles(g) {
            let names: Vec<String> = comp
                .iter()
                .map(|m| {
                    let mut p = parent.clone();
                    p.push(m.clone());
                    show(&p)
                })
                .collect();
            if c.name == "library"
                && KNOWN_CYCLES
                    .iter()
                    .any(|k| k.iter().map(|s| s.to_string()).collect::<Vec<_>>() == names)
            {
                known_seen.push(names);
                continue;
            }
            let mut msg = format!("{}: cycle between modules {}:", c.name, names.join(", "));
            for a in &comp {
                for b in g.get(a).into_iter().flatten().filter(|b| comp.contains(b)) {
                    for s in sites[&(parent.clone(), a.clone(), b.clone())]
                        .iter()
                        .take(3)
                    {
                        let _ = write!(msg, "\n    {s}");
                    }
                }
            }
            problems.push(msg);
        }
    }
    let top = graphs.remove(&Vec::new()).unwrap_or_default();
    if layered {
        let rank = |m: &str| -> Option<(usize, usize)> {
            LAYERS.iter().enumerate().find_map(|(l, (_, mods))| {
                mods.iter()
                    .position(|x| *x == m)
                    .map(|p| (l, if mods == &ENGINES { p } else { 0 }))
            })
        };
        for top_module in c
            .files
            .keys()
            .filter_map(|m| m.first())
            .collect::<BTreeSet<_>>()
        {
            if rank(top_module).is_none() {
                problems.push(format!(
                    "library: module `{top_module}` is in no layer: add it to LAYERS / ENGINES in tests/layers.rs and to the README's Architecture section"
                ));
            }
        }
        for (from, to, file, line) in &edges {
            let (Some(f), Some(t)) = (from.first(), to.first()) else {
                continue;
            };
            if f == t {
                continue;
            }
            if let (Some(rf), Some(rt)) = (rank(f), rank(t))
                && rt > rf
            {
                let why = if rt.0 > rf.0 {
                    format!(
                        "layer `{}` imports layer `{}`",
                        LAYERS[rf.0].0, LAYERS[rt.0].0
                    )
                } else {
                    "an engine imports a later engine (see ENGINES)".to_owned()
                };
                problems.push(format!(
                    "library: upward import {} -> {} at {}:{line}: {why}",
                    show(from),
                    show(to),
                    file.display()
                ));
            }
        }
    }
    (problems, known_seen, top)
}

fn all_crates() -> Vec<Crate> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bin_dir = root.join("src/bin");
    let mut crates = vec![read_crate(
        "library",
        &root.join("src/lib.rs"),
        Some(&bin_dir),
    )];
    let mut bins: Vec<_> = std::fs::read_dir(&bin_dir)
        .map(|d| d.map(|e| e.expect("entry").path()).collect())
        .unwrap_or_default();
    bins.sort();
    for p in bins {
        if p.is_dir() {
            crates.push(read_crate(
                &format!("bin {}", p.display()),
                &p.join("main.rs"),
                None,
            ));
        }
    }
    let py = root.join("python/src/lib.rs");
    if py.exists() {
        crates.push(read_crate("python extension", &py, None));
    }
    crates
}

#[test]
fn layers_hold_and_modules_form_no_cycle() {
    let mut problems = Vec::new();
    let mut known = Vec::new();
    for c in all_crates() {
        let (p, k, top) = check(&c, c.name == "library");
        problems.extend(p);
        known.extend(k);
        if c.name == "library" {
            println!("top-level imports of the library:");
            for (m, to) in &top {
                println!(
                    "  {m} -> {}",
                    to.iter().cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
    }
    for k in &known {
        println!("known cycle (see KNOWN_CYCLES): {}", k.join(", "));
    }
    for k in KNOWN_CYCLES {
        if !known
            .iter()
            .any(|s| s.iter().map(String::as_str).eq(k.iter().copied()))
        {
            problems.push(format!(
                "known cycle {k:?} is gone: remove it from KNOWN_CYCLES in tests/layers.rs"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} layering problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

// The checker on small sources, so that it cannot pass by seeing nothing.

fn fake(files: &[(&[&str], &str)]) -> Crate {
    Crate {
        name: "library".into(),
        files: files
            .iter()
            .map(|(m, src)| {
                (
                    m.iter().map(|s| s.to_string()).collect(),
                    (PathBuf::from(m.join("/")), refs(&lex(src))),
                )
            })
            .collect(),
    }
}

#[test]
fn checker_sees_use_trees_inline_paths_and_super() {
    let c = fake(&[
        (&[], "pub mod model; pub mod plan; pub use model::Key;"),
        (&["model"], "pub use key::Key; mod key;"),
        (&["model", "key"], "pub struct Key;"),
        (
            &["plan"],
            "/* crate::storage */ use crate::{model::{self, Key as K}, Key}; // crate::save\n\
             fn f() { let s = \"crate::load::x\"; let c = '{'; let l: &'static str = r#\"crate::x\"#; crate::model::key::Key; }\n\
             mod tests { use super::*; use super::super::model::Key; }",
        ),
    ]);
    let edges = c.edges();
    let plan = vec!["plan".to_string()];
    let to: BTreeSet<String> = edges
        .iter()
        .filter(|e| e.0 == plan)
        .map(|e| show(&e.1))
        .collect();
    assert_eq!(
        to,
        BTreeSet::from(["model".into(), "model::key".into()]),
        "{edges:?}"
    );
    assert!(
        edges
            .iter()
            .all(|e| !show(&e.1).contains("storage") && !show(&e.1).contains("load"))
    );
}

#[test]
fn checker_reports_upward_imports_and_cycles() {
    let c = fake(&[
        (
            &[],
            "pub mod model; pub mod plan; pub mod error; pub use error::Error;",
        ),
        (&["model"], "fn f() -> crate::Error { todo!() }"),
        (&["plan"], "mod a; mod b; pub use a::X;"),
        (&["plan", "a"], "use crate::plan::b::Y;"),
        (&["plan", "b"], "fn g() { super::a::X; }"),
        (&["error"], "use crate::model::M; pub struct Error;"),
    ]);
    let (problems, _, _) = check(&c, true);
    let all = problems.join("\n");
    assert!(all.contains("upward import model -> error"), "{all}");
    assert!(
        all.contains("cycle between modules plan::a, plan::b"),
        "{all}"
    );
    assert!(all.contains("cycle between modules error, model"), "{all}");
    assert!(!all.contains("plan -> plan::a"), "{all}");
}
