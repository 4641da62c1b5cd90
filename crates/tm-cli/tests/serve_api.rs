//! `tm-cli serve` over a real TCP socket on 127.0.0.1, with the tiny fixture model: chat and
//! completions (plain and streamed), errors in the OpenAI shape, auth, queue full, client
//! disconnects freeing KV blocks, /metrics, graceful shutdown.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server process on a free port, killed on drop.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let model = format!("{}/../../fixtures/qwen3", env!("CARGO_MANIFEST_DIR"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_tm-cli"))
            .args(["serve", "--model", &model, "--port", "0", "--block-size", "16", "--max-len", "512"])
            .args(if extra.contains(&"--num-blocks") { &[][..] } else { &["--num-blocks", "128"][..] })
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning tm-cli serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("the server exited before listening").unwrap();
            eprintln!("server: {line}");
            if let Some(at) = line.find("http://") {
                break line[at + 7..].split_whitespace().next().unwrap().to_string();
            }
        };
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                eprintln!("server: {line}");
            }
        });
        Server { child, addr }
    }

    fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&str>) -> (u16, String) {
        let mut s = self.send(method, path, headers, body);
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
        let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
        (status, if chunked { dechunk(body) } else { body.to_string() })
    }

    fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&str>) -> TcpStream {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let body = body.unwrap_or("");
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", self.addr);
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()));
        s.write_all(req.as_bytes()).unwrap();
        s
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.request("POST", path, &[], Some(&body.to_string()));
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
    }

    /// Streams `body` to `path`; returns the status and every `data:` payload.
    fn stream(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let (status, text) = self.request("POST", path, &[], Some(&body.to_string()));
        (status, events(&text))
    }

    fn metrics(&self) -> String {
        let (status, text) = self.request("GET", "/metrics", &[], None);
        assert_eq!(status, 200);
        text
    }

    fn metric(&self, name: &str) -> f64 {
        let text = self.metrics();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).map(|v| v.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }

    /// Waits until `name` reads `want`.
    fn wait_metric(&self, name: &str, want: f64) {
        let t0 = Instant::now();
        loop {
            let v = self.metric(name);
            if v == want {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "{name} stays at {v}, expected {want}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Decodes a chunked transfer-encoded body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The `data:` payloads of an SSE body.
fn events(text: &str) -> Vec<String> {
    text.split("\n\n").filter_map(|e| e.trim().strip_prefix("data: ")).map(str::to_string).collect()
}

fn assert_error(status: u16, body: &Value, want: u16) {
    assert_eq!(status, want, "{body}");
    let e = &body["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(e["type"].is_string(), "{body}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{body}");
}

#[test]
fn chat_completion_non_streaming() {
    let s = Server::start(&[]);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "qwen3", "messages": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                "max_tokens": 8, "temperature": 0, "seed": 1, "user": "u1", "top_k": 5, "min_p": 0.01,
                "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "stop": ["zz"]}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "qwen3");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    let u = &v["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(u["completion_tokens"].as_u64().unwrap() <= 8);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    // Greedy is deterministic; n > 1 gives n choices; max_completion_tokens is honoured.
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 6,
                      "temperature": 0, "n": 3, "logprobs": true, "top_logprobs": 2});
    let (status, a) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{a}");
    let choices = a["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], choices[0]["message"]["content"]);
        let lps = c["logprobs"]["content"].as_array().unwrap();
        assert!(!lps.is_empty() && lps.len() <= 6);
        assert_eq!(lps[0]["top_logprobs"].as_array().unwrap().len(), 2);
    }
    assert!(a["usage"]["completion_tokens"].as_u64().unwrap() <= 18);
}

#[test]
fn chat_completion_streaming() {
    let s = Server::start(&[]);
    let body = json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 10,
                      "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let (status, ev) = s.stream("/v1/chat/completions", &body);
    assert_eq!(status, 200);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    let finish: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finish.len(), 1);
    let usage = &chunks.last().unwrap()["usage"];
    assert!(chunks.last().unwrap()["choices"].as_array().unwrap().is_empty());
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 10);
    // The same greedy request without streaming gives the same text.
    let mut plain = body.clone();
    plain["stream"] = json!(false);
    let (_, v) = s.post("/v1/chat/completions", &plain);
    assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), text);
    // n = 2 streams both choices; without include_usage there is no usage chunk.
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "stream": true});
    let (_, ev) = s.stream("/v1/chat/completions", &body);
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    for i in 0..2 {
        let ends =
            chunks.iter().filter(|c| c["choices"][0]["index"] == i && !c["choices"][0]["finish_reason"].is_null());
        assert_eq!(ends.count(), 1);
    }
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
}

#[test]
fn completions_plain_streaming_and_echo() {
    let s = Server::start(&[]);
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"model": "qwen3", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let (_, e) = s.post(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "echo": true, "logprobs": 1}),
    );
    assert_eq!(e["choices"][0]["text"].as_str().unwrap(), format!("Once upon a time{text}"));
    assert!(e["choices"][0]["logprobs"]["tokens"].is_array());
    // A list of prompts, n = 2 each: four choices.
    let (status, l) = s.post("/v1/completions", &json!({"prompt": ["a", "b"], "max_tokens": 3, "n": 2, "stop": "x"}));
    assert_eq!(status, 200, "{l}");
    assert_eq!(l["choices"].as_array().unwrap().len(), 4);
    // Token-id prompts.
    let (status, t) = s.post("/v1/completions", &json!({"prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(status, 200, "{t}");
    // Streaming gives the same text as the plain request.
    let (status, ev) = s.stream(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "stream": true}),
    );
    assert_eq!(status, 200);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let streamed: String = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, text);
}

#[test]
fn models_and_health() {
    let s = Server::start(&["--served-model-name", "tiny"]);
    let (status, body) = s.request("GET", "/v1/models", &[], None);
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["data"][0]["object"], "model");
    let (status, _) = s.request("GET", "/health", &[], None);
    assert_eq!(status, 200);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{v}");
}

#[test]
fn bad_requests_get_openai_errors() {
    let s = Server::start(&[]);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let long = "word ".repeat(2000);
    let cases: Vec<(&str, String, u16)> = vec![
        ("/v1/chat/completions", "{\"messages\": [".into(), 400),
        ("/v1/chat/completions", "[1, 2]".into(), 400),
        ("/v1/chat/completions", "{}".into(), 400),
        ("/v1/completions", "{\"max_tokens\": 3}".into(), 400),
        ("/v1/chat/completions", json!({"model": "gpt-4", "messages": msgs}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(), 400),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).to_string(),
            400,
        ),
        ("/v1/chat/completions", json!({"messages": msgs, "temperature": 3}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "temperature": "hot"}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "top_p": 0}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "n": 0}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "max_tokens": 0}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "max_tokens": -5}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "presence_penalty": 9}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "logprobs": true, "top_logprobs": 50}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "top_k": -7}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "min_p": 2}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": msgs, "repetition_penalty": 0}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": long}]}).to_string(), 400),
        ("/v1/completions", json!({"prompt": long}).to_string(), 400),
        ("/v1/completions", json!({"prompt": []}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [99999999]}).to_string(), 400),
        ("/v1/completions", json!({"prompt": "x", "logprobs": 99}).to_string(), 400),
        ("/v1/nothing", "{}".into(), 404),
    ];
    for (path, body, want) in cases {
        let (status, text) = s.request("POST", path, &[], Some(&body));
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} {body}: {e}: {text}"));
        assert_error(status, &v, want);
    }
    // Messages that say what was wrong, not serde's internals or a full queue.
    let named: [(&str, Value, &str, &str); 5] = [
        ("/v1/completions", json!({"prompt": [-1]}), "`prompt` must be", "prompt"),
        ("/v1/completions", json!({"prompt": "x", "stop": 5}), "`stop` must be", "stop"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "`content` must be",
            "messages[0].content",
        ),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 1e21}), "`max_tokens`", "max_tokens"),
        ("/v1/completions", json!({"prompt": vec!["x"; 9], "n": 128, "max_tokens": 1}), "1152 completions", "prompt"),
    ];
    for (path, body, needle, param) in named {
        let (status, v) = s.post(path, &body);
        assert_error(status, &v, 400);
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{body}: {message}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let (status, text) = s.request(
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&json!({"messages": [{"role": "user", "content": long}]}).to_string()),
    );
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(status, 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // The server is still fine.
    let (status, v) = s.post("/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 2}));
    assert_eq!(status, 200, "{v}");
}

#[test]
fn api_key_is_required_when_set() {
    let s = Server::start(&["--api-key", "sekrit"]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).to_string();
    for headers in [vec![], vec![("Authorization", "Bearer wrong")], vec![("Authorization", "sekrit")]] {
        let (status, text) = s.request("POST", "/v1/chat/completions", &headers, Some(&body));
        assert_error(status, &serde_json::from_str(&text).unwrap(), 401);
    }
    let (status, text) = s.request("GET", "/v1/models", &[], None);
    assert_error(status, &serde_json::from_str(&text).unwrap(), 401);
    let (status, _) = s.request("POST", "/v1/chat/completions", &[("Authorization", "Bearer sekrit")], Some(&body));
    assert_eq!(status, 200);
    let (status, _) = s.request("GET", "/health", &[], None);
    assert_eq!(status, 200);
}

/// Opens a streaming request and reads until its first content chunk.
fn open_stream(s: &Server, body: &Value) -> (TcpStream, BufReader<TcpStream>) {
    let stream = s.send("POST", "/v1/completions", &[], Some(&body.to_string()));
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains(" 200 "), "{line}");
    loop {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "the stream ended early");
        if line.starts_with("data: {") {
            return (stream, reader);
        }
    }
}

#[test]
fn disconnect_mid_stream_frees_blocks() {
    let s = Server::start(&[]);
    let body = json!({"prompt": "The story goes", "max_tokens": 400, "ignore_eos": true, "stream": true});
    // The fixture model is tiny and its context short: on a busy machine a request can finish
    // before the client's disconnect is noticed. Try a few times; one cancellation must happen,
    // and every attempt must end with no blocks held.
    let mut cancelled = false;
    for _ in 0..8 {
        let before = s.metric("tm_requests_cancelled_total");
        let (stream, reader) = open_stream(&s, &body);
        drop(reader);
        drop(stream);
        s.wait_metric("tm_kv_blocks_used", 0.0);
        s.wait_metric("tm_requests_running", 0.0);
        if s.metric("tm_requests_cancelled_total") > before {
            cancelled = true;
            break;
        }
    }
    assert!(cancelled, "no disconnect was seen as a cancellation in 8 tries");
    // Non-streaming clients that go away are cancelled too.
    let plain = json!({"prompt": "The story goes", "max_tokens": 400, "ignore_eos": true});
    let c = s.send("POST", "/v1/completions", &[], Some(&plain.to_string()));
    std::thread::sleep(Duration::from_millis(300));
    drop(c);
    s.wait_metric("tm_kv_blocks_used", 0.0);
    s.wait_metric("tm_requests_running", 0.0);
    let (status, _) = s.post("/v1/completions", &json!({"prompt": "ok", "max_tokens": 2}));
    assert_eq!(status, 200);
}

#[test]
fn full_queue_gives_429() {
    let s = Server::start(&["--max-batch-size", "1", "--max-queue", "1"]);
    let long = json!({"prompt": "Running", "max_tokens": 450, "ignore_eos": true, "stream": true});
    // The fixture model is tiny: on a fast machine both long requests can finish before the third
    // arrives. Try a few times; the queue must be seen full at least once.
    let mut refused = false;
    for _ in 0..8 {
        let running = open_stream(&s, &long);
        // The second request waits in the queue: its headers come at once, its tokens later.
        let queued = s.send("POST", "/v1/completions", &[], Some(&long.to_string()));
        let mut qr = BufReader::new(queued.try_clone().unwrap());
        let mut line = String::new();
        qr.read_line(&mut line).unwrap();
        assert!(line.contains(" 200 "), "{line}");
        let (status, v) = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
        drop(running);
        drop((queued, qr));
        s.wait_metric("tm_kv_blocks_used", 0.0);
        s.wait_metric("tm_requests_waiting", 0.0);
        if status != 200 {
            assert_error(status, &v, 429);
            refused = true;
            break;
        }
    }
    assert!(refused, "the queue was never seen full in 8 tries");
    let (status, v) = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(status, 200, "{v}");
}

#[test]
fn metrics_parse() {
    let s = Server::start(&[]);
    let _ = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}));
    let _ = s.post("/v1/chat/completions", &json!({"messages": "nope"}));
    let text = s.metrics();
    for line in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (name, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {line}"));
        assert!(value.parse::<f64>().is_ok(), "bad value in {line}");
        let bare = name.split('{').next().unwrap();
        assert!(!bare.is_empty() && bare.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'), "{line}");
        if let Some(labels) = name.strip_prefix(bare) {
            assert!(labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')), "{line}");
        }
    }
    for name in [
        "tm_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}",
        "tm_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"}",
        "tm_prompt_tokens_total",
        "tm_generation_tokens_total",
        "tm_requests_running",
        "tm_requests_waiting",
        "tm_kv_blocks_used",
        "tm_kv_blocks_total",
        "tm_time_to_first_token_seconds_count",
        "tm_time_per_output_token_seconds_bucket{le=\"+Inf\"}",
    ] {
        assert!(s.metric(name) >= 0.0);
    }
    assert_eq!(s.metric("tm_kv_blocks_total"), 128.0);
    assert!(s.metric("tm_generation_tokens_total") >= 1.0);
    assert_eq!(s.metric("tm_time_to_first_token_seconds_count"), 1.0);
}

#[test]
fn sigterm_finishes_in_flight_requests_and_exits_0() {
    let mut s = Server::start(&[]);
    let body = json!({"prompt": "Go", "max_tokens": 60, "ignore_eos": true, "stream": true});
    let (stream, mut reader) = open_stream(&s, &body);
    let pid = s.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    drop(stream);
    assert!(rest.contains("data: [DONE]"), "the request in flight completes: {rest}");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the server did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(TcpStream::connect(&s.addr).is_err(), "no longer accepting");
}

/// The percentile `p` of sorted `v`.
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((p / 100.0) * (v.len() - 1) as f64).round() as usize]
}

#[test]
fn load_200_streams_a_fifth_dropped_leaks_no_blocks() {
    let s = Server::start(&["--num-blocks", "2048"]);
    let total = 200;
    let t0 = Instant::now();
    let results: Vec<(bool, bool, f64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..total)
            .map(|i| {
                let s = &s;
                scope.spawn(move || {
                    let drop_it = i % 5 == 0;
                    let body = json!({"prompt": format!("Request number {i}"), "max_tokens": 32,
                                      "ignore_eos": true, "stream": true, "temperature": 0.8, "seed": i});
                    let start = Instant::now();
                    let (stream, mut reader) = open_stream(s, &body);
                    if drop_it {
                        drop((stream, reader));
                        return (false, true, start.elapsed().as_secs_f64());
                    }
                    let mut rest = String::new();
                    reader.read_to_string(&mut rest).unwrap();
                    (rest.contains("data: [DONE]"), false, start.elapsed().as_secs_f64())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wall = t0.elapsed();
    let completed = results.iter().filter(|r| r.0).count();
    let cancelled = results.iter().filter(|r| r.1).count();
    assert_eq!(completed + cancelled, total, "every kept stream completes");
    s.wait_metric("tm_kv_blocks_used", 0.0);
    s.wait_metric("tm_requests_running", 0.0);
    s.wait_metric("tm_requests_waiting", 0.0);
    let mut lat: Vec<f64> = results.iter().filter(|r| r.0).map(|r| r.2 * 1e3).collect();
    lat.sort_by(f64::total_cmp);
    eprintln!(
        "load: {total} requests, {completed} completed, {cancelled} cancelled, latency p50 {:.1} ms p99 {:.1} ms, \
         wall {:.2} s, blocks leaked = {}",
        percentile(&lat, 50.0),
        percentile(&lat, 99.0),
        wall.as_secs_f64(),
        s.metric("tm_kv_blocks_used")
    );
}
