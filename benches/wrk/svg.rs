//! The picture: req/s and p99 against connections, one line per target.

use std::fmt::Write as _;

use crate::load::Sample;

const COLORS: [&str; 6] = [
    "#222222", "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e",
];

/// Reads one figure off a sample.
type Metric = fn(&Sample) -> f64;

/// Two panels (req/s, p99 ms) against connections, one line per target.
pub fn svg(names: &[&str], conns: &[u32], grid: &[Vec<Sample>], title: &str) -> String {
    let (w, h) = (460.0, 300.0);
    let (ml, mr, mt, mb) = (62.0, 12.0, 50.0, 40.0);
    let mut s = String::new();
    let total_w = 2.0 * w;
    let total_h = h + 26.0 * ((names.len() as f64) / 3.0).ceil() + 30.0;
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" viewBox="0 0 {total_w} {total_h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="18" text-anchor="middle" font-size="14">{}</text>
"#,
        total_w / 2.0,
        xml(title)
    );
    let panels: [(&str, Metric); 2] = [("req/s", |s| s.rps()), ("p99 latency, ms", |s| s.p99_ms)];
    for (p, (label, f)) in panels.iter().enumerate() {
        let x0 = p as f64 * w;
        let max = grid
            .iter()
            .flat_map(|row| row.iter().map(f))
            .fold(0.0f64, f64::max)
            .max(1e-9);
        let top = nice(max);
        let px = |i: usize| x0 + ml + (w - ml - mr) * i as f64 / (conns.len().max(2) - 1) as f64;
        let py = |v: f64| mt + (h - mt - mb) * (1.0 - v / top);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            x0 + w / 2.0,
            mt - 6.0,
            label
        );
        for k in 0..=4 {
            let v = top * k as f64 / 4.0;
            let y = py(v);
            let _ = writeln!(
                s,
                r##"<line x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                x0 + ml,
                x0 + w - mr,
                x0 + ml - 4.0,
                y + 4.0,
                fmt_num(v)
            );
        }
        for (i, c) in conns.iter().enumerate() {
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{c}</text>"#,
                px(i),
                h - mb + 16.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">connections</text>"#,
            x0 + ml + (w - ml - mr) / 2.0,
            h - mb + 32.0
        );
        for (t, row) in grid.iter().enumerate() {
            let pts: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(i, smp)| format!("{:.1},{:.1}", px(i), py(f(smp))))
                .collect();
            let color = COLORS[t % COLORS.len()];
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                pts.join(" ")
            );
            for p in &pts {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>"#);
            }
        }
    }
    for (t, name) in names.iter().enumerate() {
        let x = 20.0 + (t % 3) as f64 * (total_w / 3.0);
        let y = h + 20.0 + 26.0 * (t / 3) as f64;
        let color = COLORS[t % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x + 24.0,
            x + 30.0,
            y + 4.0,
            xml(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn nice(max: f64) -> f64 {
    let mag = 10f64.powf(max.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= max {
            return m * mag;
        }
    }
    10.0 * mag
}

fn fmt_num(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 10.0 || v == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
