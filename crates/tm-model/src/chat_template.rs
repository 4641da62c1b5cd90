//! Hugging Face chat templates rendered with minijinja.
//!
//! The environment mirrors transformers' `apply_chat_template`: `trim_blocks` and
//! `lstrip_blocks` on, no trailing newline kept, loop controls, Python string/dict methods
//! (`.strip()`, `.items()`, ...), `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson`
//! that formats like Python's `json.dumps` (no HTML escaping). `{% generation %}` blocks
//! (transformers' assistant-mask marker) are accepted and render their body.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;

/// Name of the single template in a [`ChatTemplate`]'s environment (shown in error locations).
const TEMPLATE_NAME: &str = "chat_template";

/// The ChatML template used by [`ChatTemplate::chatml`].
const CHATML: &str = "{%- for message in messages %}\n\
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n\
    {%- endfor %}\n\
    {%- if add_generation_prompt %}\n\
    {{- '<|im_start|>assistant\\n' }}\n\
    {%- endif %}\n";

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn template_error(e: minijinja::Error) -> ModelError {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    ModelError::Template(msg)
}

impl ChatTemplate {
    /// Compiles a chat template source (Jinja, as in `tokenizer_config.json`'s `chat_template`).
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(template_error)?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source)).map_err(template_error)?;
        Ok(ChatTemplate { env })
    }

    /// The ChatML template (`<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
    /// `<|im_start|>assistant\n` for the generation prompt), for models that ship no chat
    /// template. It is only right for models trained on ChatML (Qwen, many fine-tunes).
    pub fn chatml() -> ChatTemplate {
        match ChatTemplate::new(CHATML) {
            Ok(t) => t,
            // The built-in source is a constant covered by tests.
            Err(e) => unreachable!("built-in ChatML template does not compile: {e}"),
        }
    }

    /// The template of `tok`'s model, or [`ChatTemplate::chatml`] when it has none.
    pub fn for_tokenizer(tok: &Tokenizer) -> Result<ChatTemplate> {
        match tok.chat_template() {
            Some(source) => ChatTemplate::new(source),
            None => Ok(ChatTemplate::chatml()),
        }
    }

    /// Renders `messages` with the template variables `messages`, `add_generation_prompt`,
    /// `bos_token` and `eos_token` (as transformers' `apply_chat_template(tokenize=False)`).
    /// Template errors, `raise_exception` messages included, become [`ModelError::Template`].
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from(BTreeMap::from([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ]))
            })
            .collect();
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        template.render(ctx).map_err(template_error)
    }
}

/// `raise_exception(msg)`: fails the render with `msg`.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {msg}")))
}

/// `strftime_now(fmt)`: the current UTC time formatted with a subset of C's strftime.
fn strftime_now(fmt: String) -> std::result::Result<String, minijinja::Error> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(&fmt, secs as i64)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Formats `unix_secs` (UTC) with `%Y %y %m %B %b %d %e %j %A %a %H %M %S %p %%` and the
/// glibc no-padding flag `%-d`, `%-m`, `%-H`, ...
fn strftime(fmt: &str, unix_secs: i64) -> std::result::Result<String, minijinja::Error> {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day as i64 + i64::from(is_leap && month > 2);
    let month_name = MONTHS[month as usize - 1];
    let weekday_name = WEEKDAYS[weekday];

    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let no_pad = spec == Some('-');
        if no_pad {
            spec = chars.next();
        }
        let num = |v: i64, width: usize| {
            if no_pad {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        let piece = match spec {
            Some('Y') => year.to_string(),
            Some('y') => num(year.rem_euclid(100), 2),
            Some('m') => num(i64::from(month), 2),
            Some('B') => month_name.to_owned(),
            Some('b') | Some('h') => month_name[..3].to_owned(),
            Some('d') => num(i64::from(day), 2),
            Some('e') => {
                if no_pad {
                    day.to_string()
                } else {
                    format!("{day:2}")
                }
            }
            Some('j') => num(yday, 3),
            Some('A') => weekday_name.to_owned(),
            Some('a') => weekday_name[..3].to_owned(),
            Some('H') => num(hour, 2),
            Some('I') => num(if hour % 12 == 0 { 12 } else { hour % 12 }, 2),
            Some('M') => num(minute, 2),
            Some('S') => num(second, 2),
            Some('p') => if hour < 12 { "AM" } else { "PM" }.to_owned(),
            Some('%') => "%".to_owned(),
            Some(other) => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported format directive %{other}"),
                ))
            }
            None => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "strftime_now: format ends with a lone %",
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// `tojson(indent=None)` as transformers defines it: `json.dumps(value, ensure_ascii=False,
/// indent=indent)`, i.e. `", "`/`": "` separators on one line, or `","` plus newlines with
/// `indent`; nothing is HTML-escaped.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    // Python's json.dumps accepts but does not need these; ignore them like HF's filter does.
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(
            usize::try_from(v)
                .map_err(|_| minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an integer"))?,
        ),
    };
    let mut out = String::new();
    write_json(&mut out, value, indent, 0, sort_keys.unwrap_or(false))?;
    Ok(Value::from_safe_string(out))
}

fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn newline_indent(out: &mut String, indent: Option<usize>, level: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * level));
    }
}

/// Python `json.dumps` layout of a minijinja value.
fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    level: usize,
    sort_keys: bool,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default()),
        ValueKind::Number => {
            if let Ok(i) = i64::try_from(value.clone()) {
                out.push_str(&i.to_string());
            } else if let Ok(f) = f64::try_from(value.clone()) {
                if f.is_finite() {
                    // Python prints floats with a fractional part (1.0, not 1).
                    let s = format!("{f:?}");
                    out.push_str(&s);
                } else {
                    out.push_str(if f.is_nan() {
                        "NaN"
                    } else if f > 0.0 {
                        "Infinity"
                    } else {
                        "-Infinity"
                    });
                }
            } else {
                out.push_str(&value.to_string());
            }
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline_indent(out, indent, level + 1);
                match key.as_str() {
                    Some(s) => write_json_str(out, s),
                    None => write_json_str(out, &key.to_string()),
                }
                out.push_str(": ");
                let item = value.get_item(key)?;
                write_json(out, &item, indent, level + 1, sort_keys)?;
            }
            newline_indent(out, indent, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline_indent(out, indent, level + 1);
                write_json(out, item, indent, level + 1, sort_keys)?;
            }
            newline_indent(out, indent, level);
            out.push(']');
        }
        _ => write_json_str(out, &value.to_string()),
    }
    Ok(())
}

/// Turns transformers' `{% generation %}` / `{% endgeneration %}` markers into
/// `{% if true %}` / `{% endif %}`, keeping whitespace-control dashes.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (left, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, right) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => out.push_str(&format!("{{%{left} {r} {right}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<ChatMessage> {
        vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi 🙂")]
    }

    #[test]
    fn is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }

    #[test]
    fn chatml_renders() {
        let out = ChatTemplate::chatml().render(&msgs(), true, "", "").unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = ChatTemplate::chatml().render(&msgs(), false, "", "").unwrap();
        assert!(out.ends_with("<|im_end|>\n"));
    }

    #[test]
    fn raise_exception_message_is_visible() {
        let t = ChatTemplate::new("{{ raise_exception('Roles must alternate, got ' + messages[0].role) }}").unwrap();
        let err = t.render(&msgs(), true, "", "").unwrap_err();
        assert!(matches!(err, ModelError::Template(_)));
        let s = err.to_string();
        assert!(s.contains("Roles must alternate, got system"), "{s}");
    }

    #[test]
    fn syntax_error_is_template_error() {
        let err = ChatTemplate::new("{% for m in messages %}").unwrap_err();
        assert!(matches!(err, ModelError::Template(_)), "{err}");
    }

    #[test]
    fn trim_and_lstrip_blocks() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let out = ChatTemplate::new(src).unwrap().render(&msgs(), false, "", "").unwrap();
        assert_eq!(out, "[Hi 🙂]\n");
    }

    #[test]
    fn bos_eos_and_pycompat() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m['content'].strip().upper() }}|{{ m.role.startswith('sys') }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}GO{% endif %}";
        let out = ChatTemplate::new(src).unwrap().render(&msgs(), true, "<s>", "</s>").unwrap();
        assert_eq!(out, "<s>BE BRIEF.|True</s>HI 🙂|False</s>GO");
    }

    #[test]
    fn loop_controls_and_namespace() {
        let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m.role }}{% endfor %}{{ ns.n }}";
        let out = ChatTemplate::new(src).unwrap().render(&msgs(), true, "", "").unwrap();
        assert_eq!(out, "user1");
    }

    #[test]
    fn tojson_like_python() {
        let src =
            "{{ {'a': [1, 2.5, 'x<y>'], 'b': none, 'c': true} | tojson }}|{{ [1, {'k': 'é'}] | tojson(indent=2) }}";
        let out = ChatTemplate::new(src).unwrap().render(&[], false, "", "").unwrap();
        assert_eq!(out, "{\"a\": [1, 2.5, \"x<y>\"], \"b\": null, \"c\": true}|[\n  1,\n  {\n    \"k\": \"é\"\n  }\n]");
    }

    #[test]
    fn generation_tags_are_accepted() {
        let src = "{% for m in messages %}{%- generation -%} {{ m.role }} {%- endgeneration %}{% endfor %}";
        let out = ChatTemplate::new(src).unwrap().render(&msgs(), false, "", "").unwrap();
        assert_eq!(out, "systemuser");
    }

    #[test]
    fn strftime_formats() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "26 Jul 2024");
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t).unwrap(), "2024-07-26 13:05:09");
        assert_eq!(strftime("%B %-d, %A %a %j %y %%", t).unwrap(), "July 26, Friday Fri 208 24 %");
        assert_eq!(strftime("%d %B %Y", 0).unwrap(), "01 January 1970");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400).unwrap(), "2000-02-29");
        assert!(strftime("%Q", 0).is_err());
        let out = ChatTemplate::new("{{ strftime_now('%Y') }}").unwrap().render(&[], false, "", "").unwrap();
        assert!(out.len() == 4 && out.starts_with('2'), "{out}");
    }

    #[test]
    fn chat_message_serde() {
        let m: ChatMessage = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
        assert_eq!(m, ChatMessage::new("user", "hi"));
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"role":"user","content":"hi"}"#);
    }
}
