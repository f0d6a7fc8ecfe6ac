use flashgen::attention;

attention! {
    Bad {
        dtype: f16, head_dim: 64,
        mask: (q >= k) & (q - k < 128),
    }
}

fn main() {}
