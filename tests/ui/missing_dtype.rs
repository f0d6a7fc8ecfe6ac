use flashgen::attention;

attention! {
    Bad {
        head_dim: 128,
        mask: q >= k,
    }
}

fn main() {}
