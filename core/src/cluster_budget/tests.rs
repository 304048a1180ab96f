use super::*;

fn budget(n: u32, secs: u64) -> Budget {
    Budget::new(n, Duration::from_secs(secs)).unwrap()
}

#[test]
fn takes_until_the_window_is_full_then_says_when_room_comes() {
    let b = budget(2, 600);
    let one = take(None, b, 1_000_000).unwrap();
    assert_eq!(one, "1000000");
    let two = take(Some(&one), b, 1_060_000).unwrap();
    assert_eq!(two, "1000000,1060000");
    match take(Some(&two), b, 1_120_000) {
        Err(Refused::Exhausted { taken, free_in, .. }) => {
            assert_eq!(taken, 2);
            assert_eq!(free_in, Duration::from_secs(480));
        }
        other => panic!("{other:?}"),
    }
    // The first leaves the window 600 s after it was taken.
    assert_eq!(take(Some(&two), b, 1_600_000).unwrap(), "1060000,1600000");
}

#[test]
fn an_unreadable_ledger_refuses() {
    let b = budget(5, 60);
    for bad in ["x", "1,,2", "1;2", "-5"] {
        assert!(
            matches!(take(Some(bad), b, 10), Err(Refused::Unreadable(_))),
            "{bad}"
        );
    }
    let long = vec!["1"; MAX_EVICTIONS as usize + 1].join(",");
    assert!(matches!(
        take(Some(&long), b, 10),
        Err(Refused::Unreadable(_))
    ));
    assert_eq!(take(Some("  "), b, 10).unwrap(), "10");
}

#[test]
fn entries_from_a_clock_ahead_count_until_they_leave_the_window_here() {
    let b = budget(1, 60);
    // Another agent's clock is 30 s ahead.
    let ledger = "130000";
    assert!(matches!(
        take(Some(ledger), b, 100_000),
        Err(Refused::Exhausted { .. })
    ));
    assert_eq!(take(Some(ledger), b, 190_000).unwrap(), "190000");
}

#[test]
fn budgets_are_bounded() {
    assert!(Budget::new(0, Duration::ZERO).is_ok_and(|b| !b.is_on()));
    assert!(Budget::new(MAX_EVICTIONS + 1, Duration::from_secs(60)).is_err());
    assert!(Budget::new(5, Duration::from_millis(10)).is_err());
    let e = Refused::Exhausted {
        taken: 50,
        window: Duration::from_secs(600),
        free_in: Duration::from_millis(1500),
    };
    assert_eq!(
        e.to_string(),
        "the cluster-wide eviction budget is spent: 50 evictions in the last 600s; the next is free in 2s"
    );
}
