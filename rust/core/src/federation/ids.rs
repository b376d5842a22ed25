//! The message ids of a batch, kept in one buffer. A link sends and stores
//! records by the batch and needs their ids afterwards (to settle them in
//! the seen-id window and audit them); a `String` per id was an allocation
//! and a free per record on each side of a link, often on another thread.

/// A list of ids in one buffer.
#[derive(Debug, Default)]
pub struct IdList {
    text: String,
    /// Where each id ends in `text`.
    ends: Vec<usize>,
}

impl IdList {
    /// Appends `id`.
    pub fn push(&mut self, id: &str) {
        self.text.push_str(id);
        self.ends.push(self.text.len());
    }

    /// The number of ids.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether the list holds no id.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The ids in the order they were pushed.
    pub fn iter(&self) -> impl Iterator<Item = &str> + Clone + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(&self.ends)
            .map(|(start, &end)| &self.text[start..end])
    }

    /// The last id pushed.
    pub fn last(&self) -> Option<&str> {
        let end = *self.ends.last()?;
        let start = match self.ends.len() {
            1 => 0,
            n => self.ends[n - 2],
        };
        Some(&self.text[start..end])
    }
}

#[cfg(test)]
mod tests {
    use super::IdList;

    #[test]
    fn ids_come_back_in_order_empty_ones_included() {
        let mut ids = IdList::default();
        assert!(ids.is_empty() && ids.last().is_none() && ids.iter().next().is_none());
        for id in ["a", "", "0197a3c5-5e21-7b4f-8c2d-4a1b2c3d4e5f", "ü"] {
            ids.push(id);
        }
        assert_eq!(ids.len(), 4);
        assert_eq!(
            ids.iter().collect::<Vec<_>>(),
            ["a", "", "0197a3c5-5e21-7b4f-8c2d-4a1b2c3d4e5f", "ü"]
        );
        assert_eq!(ids.last(), Some("ü"));
    }
}
