use flashgen::attention;

attention! {
    Bad {
        dtype: bf16, head_dim: 128,
        score: score + (k - q),
    }
}

fn main() {}
