//! Plain-text output for the terminal.

/// Left-aligned text table.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| -> String {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            s.push_str(c);
            s.push_str(&" ".repeat(w[i] - c.chars().count() + 2));
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.iter().map(|s| s.to_string()).collect());
    for r in rows {
        out.push_str(&line(r.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_align_to_the_widest_cell() {
        let t = super::table(&["a", "bb"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "a    bb\nxyz  1\n");
    }
}
