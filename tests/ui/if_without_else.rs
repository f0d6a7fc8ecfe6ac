use flashgen::attention;

attention! {
    Bad {
        dtype: f16, head_dim: 64,
        score: if q >= k { score },
    }
}

fn main() {}
