use flashgen::attention;

attention! {
    Bad {
        dtype: bf16, head_dim: 640,
    }
}

fn main() {}
