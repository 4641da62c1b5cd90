//! Prints the top-5 logits at every position of a token-id prompt (debugging aid):
//! `cargo run --release -p tm-model --example dump_logits -- MODEL ID ID ...`

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = std::path::PathBuf::from(args.first().ok_or("usage: dump_logits MODEL ID...")?);
    let ids: Vec<u32> = args[1..].iter().map(|s| s.parse()).collect::<Result<_, _>>()?;
    let ops = tm_cpu::CpuBackend::new();
    let m = tm_model::loader::load(&path, &ops, &mut |_, _| {})?;
    let mut s = tm_model::generate::Session::new(&m.model, &ops, 4096, 64)?;
    let logits = s.prompt_logits(&ids)?;
    let vocab = m.model.config.vocab_size;
    for (p, row) in logits.chunks(vocab).enumerate() {
        let mut idx: Vec<usize> = (0..vocab).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let top: Vec<String> = idx[..5].iter().map(|&i| format!("{i}:{:.3}", row[i])).collect();
        println!("{p}: {}", top.join(" "));
    }
    Ok(())
}
