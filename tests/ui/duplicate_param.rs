use flashgen::attention;

attention! {
    Bad {
        dtype: f16, head_dim: 64,
        param window: i32,
        param window: f32,
        mask: q - k < window,
    }
}

fn main() {}
