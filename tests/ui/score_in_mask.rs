use flashgen::attention;

attention! {
    Bad {
        dtype: bf16, head_dim: 128,
        mask: score > 0.0,
    }
}

fn main() {}
