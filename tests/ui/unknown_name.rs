use flashgen::attention;

attention! {
    Bad {
        dtype: bf16, head_dim: 128,
        mask: q >= j,
    }
}

fn main() {}
