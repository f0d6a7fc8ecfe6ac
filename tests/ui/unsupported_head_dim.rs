use flashgen::attention;

attention! {
    Bad {
        dtype: bf16, head_dim: 512,
    }
}

fn main() {}
