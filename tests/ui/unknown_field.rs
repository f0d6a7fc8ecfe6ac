use flashgen::attention;

attention! {
    Bad {
        dtype: bf16, head_dim: 128,
        masks: q >= k,
    }
}

fn main() {}
