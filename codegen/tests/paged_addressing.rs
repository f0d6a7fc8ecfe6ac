//! Paged K/V addressing (`flashgen_codegen::paged`, the CPU twin of
//! `library/paged.cuh`): with a valid block table every key lands on its
//! page's row; whatever the lengths and page ids hold, every read stays
//! inside the block table and the caches. The paged decode kernel's tile
//! copy resolves each key once and copies every chunk of the tile once.

use flashgen_codegen::paged::{
    page_slot, paged_kv_len, paged_row, query_span, warp_tile_copy, warp_tile_row, PagedRows,
};
use flashgen_codegen::varlen::SeqSpan;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_key_stays_inside_the_table_and_the_cache(
        page_size in prop_oneof![Just(1), Just(3), Just(16), Just(64), Just(256), 1..300i32],
        pages_per_seq in 0..6i32,
        num_pages in 0..12i32,
        ids in prop::collection::vec(-5..20i32, 6),
        kv_len in -10..2000i32,
        max_len in 0..2000i32,
    ) {
        let pages = &ids[..pages_per_seq as usize];
        let len = paged_kv_len(&[kv_len], 0, pages_per_seq, page_size, num_pages, max_len);
        prop_assert!(0 <= len && len <= max_len && len as i64 <= pages_per_seq as i64 * page_size as i64);
        let (row_stride, page_stride) = (8i64, 8 * page_size as i64 + 3);
        let p = PagedRows { pages, page_size, num_pages, page_stride, row_stride };
        for k in 0..len {
            let offset = paged_row(&p, k);
            let (page, row) = (offset / page_stride, offset % page_stride / row_stride);
            prop_assert!((0..num_pages as i64).contains(&page) && (0..page_size as i64).contains(&row));
            // Valid ids address exactly their row.
            let id = pages[(k / page_size) as usize];
            if (0..num_pages).contains(&id) {
                prop_assert_eq!((page, row), (id as i64, (k % page_size) as i64));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The decode kernel's keys: each lane's resolved (page, row) is the
    /// key's `paged_row`, and the tile's rows at the sequence's end read no
    /// table entry past its pages.
    #[test]
    fn resolved_keys_are_paged_rows(
        page_size in prop_oneof![Just(1), Just(16), Just(64), Just(256), 1..300i32],
        ids in prop::collection::vec(-5..40i32, 40),
        kv_len in 0..2000i32,
        first in (0..40i32).prop_map(|t| t * 64),
    ) {
        let pages_per_seq = (kv_len + page_size - 1) / page_size;
        prop_assume!(pages_per_seq as usize <= ids.len());
        let pages = &ids[..pages_per_seq as usize];
        let p = PagedRows { pages, page_size, num_pages: 30, page_stride: 1000 * page_size as i64, row_stride: 1000 };
        for warp in 0..4 {
            for lane in 0..32 {
                let k = first + warp_tile_row(64, 4, warp, lane) as i32;
                if k < kv_len {
                    let (page, row) = page_slot(&p, k);
                    prop_assert_eq!(page as i64 * p.page_stride + row as i64 * p.row_stride, paged_row(&p, k));
                }
            }
        }
    }
}

/// Every (row, chunk) of a 64-row tile is copied exactly once, from the
/// lane that resolved that row's key, for every head dim's chunk count
/// (16-byte chunks of 16 to 256 columns, and single elements).
#[test]
fn the_tile_copy_covers_each_chunk_once_from_its_rows_lane() {
    let (rows, warps) = (64, 4);
    for chunks in (2..=32).step_by(2).chain([80, 128, 256]) {
        let mut copied = vec![0; rows * chunks];
        for warp in 0..warps {
            let steps = (rows / warps * chunks).div_ceil(32);
            for step in 0..steps {
                for lane in 0..32 {
                    let Some((row, chunk, source)) = warp_tile_copy((rows, warps, chunks), warp, lane, step) else {
                        continue;
                    };
                    assert_eq!(warp_tile_row(rows, warps, warp, source), row, "{chunks} chunks");
                    copied[row * chunks + chunk] += 1;
                }
            }
        }
        assert!(copied.iter().all(|&n| n == 1), "{chunks} chunks: {copied:?}");
    }
}

#[test]
fn lengths_clamp_to_the_table_and_the_longest_length() {
    // 3 pages of 16 rows: 48 keys at most, and at most max_len.
    assert_eq!(paged_kv_len(&[100, -4, 20], 0, 3, 16, 9, 64), 48);
    assert_eq!(paged_kv_len(&[100, -4, 20], 1, 3, 16, 9, 64), 0);
    assert_eq!(paged_kv_len(&[100, -4, 20], 2, 3, 16, 9, 64), 20);
    assert_eq!(paged_kv_len(&[100], 0, 3, 16, 9, 30), 30);
    // No i32 overflow in the cap; no keys in caches of no pages.
    assert_eq!(paged_kv_len(&[i32::MAX], 0, i32::MAX, 256, 9, 7), 7);
    assert_eq!(paged_kv_len(&[5], 0, 3, 16, 0, 64), 0);
}

#[test]
fn bad_page_ids_read_the_nearest_page() {
    let pages = [-3, 9];
    let p = PagedRows { pages: &pages, page_size: 4, num_pages: 5, page_stride: 100, row_stride: 10 };
    assert_eq!(paged_row(&p, 1), 10); // page 0, row 1
    assert_eq!(paged_row(&p, 6), 4 * 100 + 2 * 10); // page 4, row 2
}

#[test]
fn dense_queries_are_max_len_rows_per_sequence() {
    assert_eq!(query_span(None, 2, 30, 10), SeqSpan { start: 20, len: 10 });
    assert_eq!(query_span(Some(&[0, 4, 9]), 1, 9, 10), SeqSpan { start: 4, len: 5 });
}
