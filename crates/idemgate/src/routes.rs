//! Path templates and the route table: method + template, first match wins.
//!
//! Templates are literal segments, `{param}` segments (one non-empty segment each), and an
//! optional final `/**` that matches the prefix itself and anything below it.

use std::fmt;

use http::Method;

/// A parsed path template such as `/api/v1/orders/{order_id}/refunds` or `/api/**`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathTemplate {
    segments: Vec<Segment>,
    wildcard: bool,
    source: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param(String),
}

/// Why a path template was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid path template `{template}`: {why}")]
pub struct TemplateError {
    template: String,
    why: &'static str,
}

impl PathTemplate {
    /// Parses a template.
    ///
    /// # Errors
    /// The template does not start with `/`, has an empty or malformed `{}` segment, or uses
    /// `**` anywhere but as the last segment.
    pub fn parse(template: &str) -> Result<Self, TemplateError> {
        let err = |why| TemplateError {
            template: template.to_owned(),
            why,
        };
        let rest = template
            .strip_prefix('/')
            .ok_or_else(|| err("must start with `/`"))?;
        let mut segments = Vec::new();
        let mut wildcard = false;
        let parts: Vec<&str> = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split('/').collect()
        };
        for (i, part) in parts.iter().enumerate() {
            if *part == "**" {
                if i + 1 != parts.len() {
                    return Err(err("`**` may only be the last segment"));
                }
                wildcard = true;
            } else if let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(err("a `{param}` name must be letters, digits or `_`"));
                }
                segments.push(Segment::Param(name.to_owned()));
            } else if part.contains(['{', '}', '*']) {
                return Err(err(
                    "`{`, `}` and `*` are only allowed as whole `{param}` or `**` segments",
                ));
            } else {
                segments.push(Segment::Literal((*part).to_owned()));
            }
        }
        Ok(Self {
            segments,
            wildcard,
            source: template.to_owned(),
        })
    }

    /// Matches a request path (without query); on success, the `{param}` values in order.
    #[must_use]
    pub fn matches<'p>(&self, path: &'p str) -> Option<Vec<(&str, &'p str)>> {
        let rest = path.strip_prefix('/')?;
        // "/" has no segments ("".split('/') would yield one empty segment).
        let mut parts = rest.split('/').filter(|_| !rest.is_empty());
        let mut params = Vec::new();
        for seg in &self.segments {
            let part = parts.next()?;
            match seg {
                Segment::Literal(lit) if lit == part => {}
                Segment::Param(name) if !part.is_empty() => params.push((name.as_str(), part)),
                _ => return None,
            }
        }
        if self.wildcard || parts.next().is_none() {
            Some(params)
        } else {
            None
        }
    }
}

impl fmt::Display for PathTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// Which methods a route answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Methods(pub Vec<Method>);

impl Methods {
    #[must_use]
    pub fn contains(&self, m: &Method) -> bool {
        self.0.iter().any(|x| x == m)
    }
}

impl fmt::Display for Methods {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.0.iter().map(Method::as_str).collect();
        f.write_str(&names.join(","))
    }
}

/// A table of `T`s keyed by method and template; the first match wins.
#[derive(Debug)]
pub struct Table<T> {
    entries: Vec<(Methods, PathTemplate, T)>,
}

impl<T> Table<T> {
    #[must_use]
    pub fn new(entries: Vec<(Methods, PathTemplate, T)>) -> Self {
        Self { entries }
    }

    /// The first entry whose method and template match.
    #[must_use]
    pub fn find(&self, method: &Method, path: &str) -> Option<&T> {
        self.entries
            .iter()
            .find(|(m, t, _)| m.contains(method) && t.matches(path).is_some())
            .map(|(_, _, v)| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.entries.iter().map(|(_, _, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> PathTemplate {
        PathTemplate::parse(s).unwrap()
    }

    #[test]
    fn literal_and_params() {
        let tpl = t("/api/v1/orders/{order_id}/refunds");
        assert_eq!(
            tpl.matches("/api/v1/orders/42/refunds"),
            Some(vec![("order_id", "42")])
        );
        assert_eq!(tpl.matches("/api/v1/orders//refunds"), None);
        assert_eq!(tpl.matches("/api/v1/orders/42"), None);
        assert_eq!(tpl.matches("/api/v1/orders/42/refunds/x"), None);
        assert_eq!(t("/").matches("/"), Some(vec![]));
        assert_eq!(t("/").matches("/a"), None);
    }

    #[test]
    fn wildcard_suffix() {
        assert!(t("/**").matches("/").is_some());
        assert!(t("/**").matches("/a/b/c").is_some());
        let api = t("/api/**");
        assert!(api.matches("/api").is_some());
        assert!(api.matches("/api/x/y").is_some());
        assert!(api.matches("/apix").is_none());
        assert!(api.matches("/other").is_none());
    }

    #[test]
    fn bad_templates() {
        for bad in ["api", "/a/**/b", "/a/{}", "/a/{x", "/a/b*", "/a/{x-y}"] {
            assert!(PathTemplate::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn first_match_wins() {
        let table = Table::new(vec![
            (Methods(vec![Method::POST]), t("/orders/{id}"), 1),
            (Methods(vec![Method::POST, Method::PATCH]), t("/**"), 2),
        ]);
        assert_eq!(table.find(&Method::POST, "/orders/1"), Some(&1));
        assert_eq!(table.find(&Method::PATCH, "/orders/1"), Some(&2));
        assert_eq!(table.find(&Method::GET, "/orders/1"), None);
    }
}
