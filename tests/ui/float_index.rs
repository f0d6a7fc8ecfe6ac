use flashgen::attention;

attention! {
    Bad {
        dtype: bf16, head_dim: 128,
        tensor slopes: f32[H],
        score: score + slopes[score],
    }
}

fn main() {}
