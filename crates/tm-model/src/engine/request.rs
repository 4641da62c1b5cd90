//! What a caller sends the engine and what comes back.

use tm_core::sampling::SamplingParams;

/// Most top log-probabilities a request may ask for per token.
pub const MAX_LOGPROBS: usize = 20;

/// A prompt: text (encoded with the model's tokenizer, special tokens added) or token ids.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Text to encode.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling parameters; `sampling.seed` seeds the request's own random stream.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Strings that end generation; the text stops before the first one (not included).
    pub stop: Vec<String>,
    /// Token ids that end generation (not included), besides the model's end-of-sequence ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's end-of-sequence ids (benchmarks).
    pub ignore_eos: bool,
    /// Report the chosen token's log-probability and this many top alternatives (at most
    /// [`MAX_LOGPROBS`]).
    pub logprobs: Option<usize>,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
}

impl Request {
    /// A greedy request for `prompt` of up to 256 tokens.
    pub fn new(prompt: Prompt) -> Self {
        Request {
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            skip_special_tokens: true,
        }
    }
    /// A greedy request for token ids.
    pub fn tokens(ids: Vec<u32>) -> Self {
        Request::new(Prompt::Tokens(ids))
    }
    /// A greedy request for text.
    pub fn text(text: impl Into<String>) -> Self {
        Request::new(Prompt::Text(text.into()))
    }
    /// Sets `max_tokens`.
    pub fn with_max_tokens(mut self, n: usize) -> Self {
        self.max_tokens = n;
        self
    }
    /// Sets the sampling parameters.
    pub fn with_sampling(mut self, sampling: SamplingParams) -> Self {
        self.sampling = sampling;
        self
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string was generated (or the model's end of sequence).
    Stop,
    /// `max_tokens` or the model's context length was reached.
    Length,
    /// Cancelled (stream dropped, or the engine shut down first).
    Abort,
    /// Something failed; see [`Finished::error`].
    Error,
}

impl FinishReason {
    /// The OpenAI-style name: `stop`, `length`, `abort`, `error`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (a final stop token included).
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_prompt_tokens: usize,
}

/// Log-probabilities at one generated position (from the model's raw distribution, before
/// penalties and temperature).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    /// The token id.
    pub id: u32,
    /// Text released with this token: may be empty (an incomplete UTF-8 character, or text
    /// held back because it could begin a stop string) or hold several tokens' text.
    pub text: String,
    /// Log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// The end of a request (always the last event).
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    /// Why it ended.
    pub reason: FinishReason,
    /// Text still held back at the end (empty unless the end released some).
    pub text: String,
    /// Token counts.
    pub usage: Usage,
    /// What went wrong, for [`FinishReason::Error`].
    pub error: Option<String>,
}

/// What a request's stream yields.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token (stop tokens are not reported as tokens).
    Token(TokenEvent),
    /// The request ended.
    Finished(Finished),
}
