//! OpenAI request bodies (what clients send), parsed with serde. Responses are built as JSON
//! values in the handlers.

use serde::Deserialize;

/// `stop`: one string or a list.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged, expecting = "`stop` must be a string or an array of strings")]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopField {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Deserialize, Debug, Clone, Default)]
pub struct StreamOptions {
    /// Send a last chunk holding the usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling and output fields that chat and completions share.
#[derive(Deserialize, Debug, Clone, Default)]
pub struct CommonFields {
    /// The model name (the served name; optional).
    #[serde(default)]
    pub model: Option<String>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Temperature in [0, 2]; 0 is greedy.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling threshold in (0, 1].
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Seed of the request's random stream.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StopField>,
    /// Choices to generate.
    #[serde(default)]
    pub n: Option<i64>,
    /// Presence penalty in [-2, 2].
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty in [-2, 2].
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// An end-user id (accepted, not used).
    #[serde(default)]
    pub user: Option<String>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Extension: keep the k most likely tokens (0 or -1: off).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Extension: min-p in [0, 1].
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Extension: repetition penalty (> 0; 1 is off).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Extension: keep generating past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

/// A message's content: a string or a list of parts.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged, expecting = "a message's `content` must be a string or an array of content parts")]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts (only `text` parts are supported).
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Deserialize, Debug, Clone)]
pub struct ContentPart {
    /// The part type (`text`).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// One chat message.
#[derive(Deserialize, Debug, Clone)]
pub struct MessageIn {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The content (may be null for assistant messages).
    #[serde(default)]
    pub content: Option<Content>,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, Debug, Clone)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<MessageIn>,
    /// Shared fields.
    #[serde(flatten)]
    pub common: CommonFields,
    /// Newer name of `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// Return log-probabilities of the output tokens.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per position, 0 to 20 (needs `logprobs`).
    #[serde(default)]
    pub top_logprobs: Option<i64>,
}

/// `prompt` of a completion: text, texts, token ids, or lists of token ids.
#[derive(Deserialize, Debug, Clone)]
#[serde(
    untagged,
    expecting = "`prompt` must be a string, an array of strings, an array of token ids (integers from 0 to \
                 4294967295) or an array of such arrays"
)]
pub enum PromptField {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Deserialize, Debug, Clone)]
pub struct CompletionRequest {
    /// The prompt(s).
    pub prompt: PromptField,
    /// Shared fields.
    #[serde(flatten)]
    pub common: CommonFields,
    /// Repeat the prompt before the completion.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Alternatives per position, 0 to 20 (with the chosen token's log-probability).
    #[serde(default)]
    pub logprobs: Option<i64>,
}
