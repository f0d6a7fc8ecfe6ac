//! Short per-argument lists a launch builds (argument infos, tensor
//! pointers and their guards), on the stack up to [`FEW`] items (a spec's
//! params and tensors are a handful) and on the heap past that: a warm
//! launch of an ordinary spec allocates none.

use std::ops::Deref;

/// Items kept inline before a list moves to the heap.
pub(crate) const FEW: usize = 16;

/// A list of `Copy` values, readable as a slice.
pub(crate) enum Few<T> {
    Inline([T; FEW], usize),
    Heap(Vec<T>),
}

impl<T: Copy> Few<T> {
    /// An empty list; `fill` only pads the unused inline slots.
    pub fn new(fill: T) -> Few<T> {
        Few::Inline([fill; FEW], 0)
    }

    /// `items` in order (`fill` as for [`Few::new`]).
    pub fn of(fill: T, items: impl IntoIterator<Item = T>) -> Few<T> {
        let mut few = Few::new(fill);
        items.into_iter().for_each(|item| few.push(item));
        few
    }

    pub fn push(&mut self, item: T) {
        match self {
            Few::Inline(slots, len) if *len < FEW => {
                slots[*len] = item;
                *len += 1;
            }
            Few::Inline(slots, _) => *self = Few::Heap(slots.iter().copied().chain([item]).collect()),
            Few::Heap(items) => items.push(item),
        }
    }
}

impl<T> Deref for Few<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Few::Inline(slots, len) => &slots[..*len],
            Few::Heap(items) => items,
        }
    }
}

/// Values only kept alive (guards, until a launch is queued), of any type.
pub(crate) struct Kept<T> {
    inline: [Option<T>; FEW],
    spilled: Vec<T>,
}

impl<T> Default for Kept<T> {
    fn default() -> Kept<T> {
        Kept { inline: std::array::from_fn(|_| None), spilled: Vec::new() }
    }
}

impl<T> Kept<T> {
    pub fn push(&mut self, item: T) {
        match self.inline.iter_mut().find(|slot| slot.is_none()) {
            Some(slot) => *slot = Some(item),
            None => self.spilled.push(item),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    #[test]
    fn few_reads_back_its_items_inline_or_not() {
        for n in [0, 1, FEW - 1, FEW, FEW + 1, 3 * FEW] {
            let few = Few::of(0, 0..n);
            assert_eq!(&*few, (0..n).collect::<Vec<_>>().as_slice());
            assert_eq!(matches!(few, Few::Inline(..)), n <= FEW, "{n}");
        }
    }

    #[test]
    fn kept_keeps_every_item() {
        let item = Rc::new(());
        let mut kept = Kept::default();
        (0..FEW + 3).for_each(|_| kept.push(Rc::clone(&item)));
        assert_eq!(Rc::strong_count(&item), FEW + 4);
        drop(kept);
        assert_eq!(Rc::strong_count(&item), 1);
    }
}
