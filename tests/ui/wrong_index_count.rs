use flashgen::attention;

attention! {
    Bad {
        dtype: bf16, head_dim: 128,
        tensor doc: i32[B, KV_LEN],
        mask: doc[b] == doc[b][k],
    }
}

fn main() {}
